"""Tools, tool calls, reasoning and the chat template's options through a real mesh (1P+1D), with the official
`openai` client and the gRPC SDK, on the default model (Qwen3.5's format, random-ish weights): each reply is the
monolithic engine's text on the same prompt, as Qwen3.5's format reads it; REST and gRPC render the same prompt
from the same fields, refuse bad ones alike and read the reply into the same reasoning, content and tool calls;
tool_choice required and named are enforced by structured decoding on both."""

import asyncio
import json

import grpc
import httpx
import jsonschema
import openai
import pytest
from harness import start_mesh
from test_openai_api import thinking_reply

from deltamesh.client import AsyncClient, InvalidRequest
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.protocol.structured import StructuredOutputs
from deltamesh.services.router.chat_output import named_schema, required_schema

pytestmark = [pytest.mark.e2e, pytest.mark.api]
MODEL_ID = DEFAULT_MODEL.name
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OPEN_CALL = {"role": "assistant", "content": "<tool_call>\n<function=get_weather>\n<parameter=city>\n"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("chat"), http=True)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)


def reference(engine, messages, max_tokens=16, add_generation_prompt=True, **options):
    """The engine's greedy reply to the chat as the template renders it (messages as the template reads them)."""
    ids = engine.tokenizer.encode_chat(messages, add_generation_prompt, **options)
    return ids, engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def streamed(client, **kw):
    """(reasoning, content, tool-call deltas, finish reason) of a streamed reply."""
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning or None, content or None, [t for d in deltas for t in d.tool_calls or ()], chunks[-1]


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_on_and_off_streamed_and_whole(client, reference_engine, thinking):
    kwargs = {} if thinking else {"enable_thinking": False}
    ids, ref = reference(reference_engine, ASK, variables=kwargs)
    body = dict(model=MODEL_ID, messages=ASK, max_tokens=16, temperature=0)
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    whole = client.chat.completions.create(**body, extra_body=extra)
    message = whole.choices[0].message
    expected = thinking_reply(ref.text) if thinking else (None, ref.text)
    assert (message.reasoning_content, message.content) == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.choices[0].finish_reason == ref.finish_reason.value
    reasoning, content, calls, last = streamed(client, **body, extra_body=extra)
    assert (reasoning, content, calls, last.choices[0].finish_reason) == (*expected, [], ref.finish_reason.value)
    hidden = client.chat.completions.create(**body, extra_body=extra | {"include_reasoning": False})
    assert hidden.choices[0].message.reasoning_content is None
    assert hidden.choices[0].message.content == message.content


def test_tools_are_rendered_into_the_prompt_and_a_reply_without_calls_is_text(client, reference_engine):
    ids, ref = reference(reference_engine, ASK, tools=[WEATHER])
    assert len(ids) > len(reference_engine.tokenizer.encode_chat(ASK)) + 100  # the tools and their call format
    res = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[WEATHER], max_tokens=16, temperature=0)
    message = res.choices[0].message
    assert res.usage.prompt_tokens == len(ids) and not message.tool_calls
    assert (message.reasoning_content, message.content) == thinking_reply(ref.text)


def test_a_reply_continuing_an_open_call_returns_the_call_streamed_and_whole(mesh, client, reference_engine):
    """A random-weight model rarely starts a call itself; a prompt that ends inside one (continue_final_message)
    makes its reply the value of the call's parameter, which the qwen3_coder parser returns as a tool call."""
    messages = [*ASK, OPEN_CALL]
    ids, ref = reference(reference_engine, messages, 8, False, tools=[WEATHER], continue_final_message=True)
    assert reference_engine.tokenizer.decode(ids, skip_special_tokens=False).endswith("<parameter=city>")
    body = dict(
        model=MODEL_ID,
        messages=messages,
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    res = client.chat.completions.create(**body)
    [call] = res.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    value = ref.text.removeprefix("\n")
    if "</" not in value:  # a random model's text: the value runs to the end of the output
        assert json.loads(call.function.arguments) == {"city": value.removesuffix("\n")}
    assert res.choices[0].message.content is None and res.usage.prompt_tokens == len(ids)
    finish = "tool_calls" if ref.finish_reason.value == "stop" else "length"
    assert res.choices[0].finish_reason == finish
    _, content, calls, last = streamed(client, **body)
    assert content is None and last.choices[0].finish_reason == finish
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"  # the header first
    assert all(c.index == 0 for c in calls) and all(c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    # the official client's stream helper puts the deltas together into the same call
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    with mesh.client() as grpc_client:  # gRPC continues the same prompt (its reply is the text)
        result = grpc_client.generate(
            messages,
            tools=[WEATHER],
            add_generation_prompt=False,
            continue_final_message=True,
            max_tokens=8,
            temperature=0,
        )
    assert (result.usage.prompt_tokens, result.token_ids) == (len(ids), ref.token_ids)


def test_a_tool_result_round_trip_renders_the_same_prompt_over_rest_and_grpc(mesh, client, reference_engine):
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]
    messages = [
        {"role": "system", "content": "Answer in one sentence."},
        *ASK,
        {"role": "assistant", "content": None, "reasoning_content": "The tool knows.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    as_template_reads = [
        *messages[:2],
        {
            **messages[2],
            "content": "",
            "tool_calls": [{**calls[0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        messages[3],
    ]
    text = reference_engine.tokenizer.render_chat(as_template_reads, tools=[WEATHER])
    assert (
        "<think>\nThe tool knows.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n" in text
    )
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nSunny, 24 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    for kwargs in ({}, {"enable_thinking": False}):
        ids, ref = reference(reference_engine, as_template_reads, tools=[WEATHER], variables=kwargs)
        res = client.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            tools=[WEATHER],
            max_tokens=16,
            temperature=0,
            extra_body={"chat_template_kwargs": kwargs},
        )
        message = res.choices[0].message
        expected = thinking_reply(ref.text) if not kwargs else (None, ref.text)
        assert res.usage.prompt_tokens == len(ids) and (message.reasoning_content, message.content) == expected
        with mesh.client() as grpc_client:  # the same fields over gRPC: the same prompt, the same tokens
            result = grpc_client.generate(
                messages, tools=[WEATHER], chat_template_kwargs=kwargs, max_tokens=16, temperature=0
            )
        assert (result.usage.prompt_tokens, result.token_ids) == (len(ids), ref.token_ids)


BAD = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not in tools",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "tool name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
        "tools",
        "not a valid JSON Schema",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools",
        "type 'object'",
    ),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "cannot set tools"),
    (
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
        "messages",
        "arguments must be a JSON object",
    ),
]


@pytest.mark.parametrize("fields,param,words", BAD)
def test_bad_tool_and_template_fields_are_refused_alike_on_both_edges(mesh, fields, param, words):
    body = {"model": MODEL_ID, "messages": ASK, "max_tokens": 2} | fields
    r = httpx.post(f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and words in error["message"], r.text
    grpc_fields = {k: v for k, v in fields.items() if k != "messages"}
    with mesh.client(retries=0) as grpc_client, pytest.raises(InvalidRequest) as refused:
        grpc_client.generate(body["messages"], max_tokens=2, **grpc_fields)
    assert (refused.value.code, refused.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, error["message"])
    assert mesh.wait_idle() == {}


def test_a_tools_definition_takes_only_openais_fields_and_a_forced_choice_takes_no_other_structure(mesh):
    url = f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions"
    typo = {"type": "function", "function": {"name": "f", "parameter": {}}}
    r = httpx.post(url, json={"model": MODEL_ID, "messages": ASK, "tools": [typo]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Unrecognized request argument"), r.text
    for choice in ("required", NAMED):
        body = {"model": MODEL_ID, "messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 2}
        r = httpx.post(url, json=body | {"response_format": {"type": "json_object"}}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "tool_choice" and "response_format" in error["message"]
        with mesh.client(retries=0) as grpc_client, pytest.raises(InvalidRequest) as refused:
            grpc_client.generate(ASK, tools=[WEATHER], tool_choice=choice, structured_outputs={"json_object": True})
        assert (refused.value.code, refused.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, error["message"])
    assert mesh.wait_idle() == {}


# A tool whose arguments are a few tokens: a random-weight model under its schema ends the JSON within max_tokens
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lyon"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "choice,parallel",
    [("required", False), ("required", True), ({"type": "function", "function": {"name": "forecast"}}, True)],
)
def test_a_forced_tool_choice_is_enforced_by_structured_decoding_streamed_and_whole(
    mesh, client, reference_engine, choice, parallel
):
    """tool_choice required / named: the reply is written under the JSON schema built from the tools (thinking off),
    so it parses into calls of the tools with arguments that match their schemas; the mesh's tokens are the
    monolithic engine's under the same schema. Over REST and gRPC (both SDK clients) alike."""
    tools = [FORECAST, CLOCK]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = isinstance(choice, dict)
    schema = named_schema(parameters["forecast"]) if named else required_schema(parameters, parallel)
    ids = reference_engine.tokenizer.encode_chat(ASK, True, tools=tools, variables={"enable_thinking": False})
    params = SamplingParams(
        max_tokens=96, temperature=0, structured_outputs=StructuredOutputs(json=schema, disable_any_whitespace=True)
    )
    ref = reference_engine.generate(ids, params)[0]
    assert ref.finish_reason.value == "stop", ref.text  # the schema's JSON was finished
    written = json.loads(ref.text)
    jsonschema.validate(written, schema)
    expected = [("forecast", written)] if named else [(c["name"], c["parameters"]) for c in written]
    body = dict(model=MODEL_ID, messages=ASK, tools=tools, tool_choice=choice, max_tokens=96, temperature=0)
    body["parallel_tool_calls"] = parallel
    res = client.chat.completions.create(**body)
    message, finish = res.choices[0].message, "stop" if named else "tool_calls"
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == len(ref.token_ids)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == expected
    assert all(c.id.startswith("call_") for c in message.tool_calls) and res.choices[0].finish_reason == finish
    assert message.content is None and message.reasoning_content is None
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    reasoning, content, deltas, last = streamed(client, **body)
    assert (reasoning, content, last.choices[0].finish_reason) == (None, None, finish)
    headers = [d for d in deltas if d.id]
    assert [(d.index, d.function.name) for d in headers] == [
        (i, c.function.name) for i, c in enumerate(message.tool_calls)
    ]
    joined = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in range(len(headers))]
    assert [json.loads(a) for a in joined] == [json.loads(c.function.arguments) for c in message.tool_calls]

    grpc_fields = dict(tools=tools, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=96, temperature=0)
    with mesh.client() as grpc_client:
        result = grpc_client.generate(ASK, **grpc_fields)
    assert (result.usage.prompt_tokens, result.token_ids) == (len(ids), ref.token_ids)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == expected
    assert (result.reasoning, result.content, result.finish_reason) == ("", "", finish)  # REST's finish reason
    for call in result.tool_calls:
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), parameters[call.name])

    async def stream_async() -> list:
        async with AsyncClient(mesh.router_address, **mesh.client_kwargs) as async_client:
            return [d.chat async for d in async_client.stream(ASK, **grpc_fields)]

    pieces = asyncio.run(stream_async())
    assert all(p is not None for p in pieces) and not any(p.reasoning or p.content for p in pieces)
    calls = [c for p in pieces for c in p.tool_calls]
    assert [(c.index, c.name) for c in calls if c.id] == [(i, c.name) for i, c in enumerate(result.tool_calls)]
    assert all(c.id is None and c.name is None for c in calls if c.id is None)
    joined = ["".join(c.arguments for c in calls if c.index == i) for i in range(len(result.tool_calls))]
    assert [json.loads(a) for a in joined] == [args for _, args in expected]


def test_a_chat_under_structured_outputs_is_rendered_without_thinking_on_both_edges(mesh, client, reference_engine):
    """The grammar holds from the reply's first token, so REST and gRPC both render the chat with thinking off
    (unless chat_template_kwargs turns it on) and REST returns the whole reply as content."""
    spec = {"choice": ["sunny", "rainy"]}
    for kwargs in ({}, {"enable_thinking": True}):
        variables = {"enable_thinking": False} | kwargs
        ids = reference_engine.tokenizer.encode_chat(ASK, True, variables=variables)
        params = SamplingParams(
            max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(choice=spec["choice"])
        )
        ref = reference_engine.generate(ids, params)[0]
        assert ref.text in spec["choice"]
        extra = {"structured_outputs": spec, "chat_template_kwargs": kwargs}
        res = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, max_tokens=8, temperature=0, extra_body=extra
        )
        message = res.choices[0].message
        assert (res.usage.prompt_tokens, message.content, message.reasoning_content) == (len(ids), ref.text, None)
        with mesh.client() as grpc_client:
            result = grpc_client.generate(
                ASK, structured_outputs=spec, chat_template_kwargs=kwargs, max_tokens=8, temperature=0
            )
        assert (result.usage.prompt_tokens, result.token_ids) == (len(ids), ref.token_ids)


OPEN_CALL_FIELDS = dict(
    messages=[*ASK, OPEN_CALL], tools=[WEATHER], add_generation_prompt=False, continue_final_message=True
)
PARITY = [  # (the request's chat fields, what its reply must hold for the comparison to say something)
    pytest.param(dict(messages=ASK), "reasoning", id="thinking"),
    pytest.param(dict(messages=ASK, chat_template_kwargs={"enable_thinking": False}), "content", id="no-thinking"),
    pytest.param(dict(messages=ASK, tools=[WEATHER]), "reasoning", id="tools-auto"),
    pytest.param(OPEN_CALL_FIELDS, "tool_calls", id="auto-call"),
    pytest.param(dict(messages=ASK, tools=[FORECAST, CLOCK], tool_choice="required"), "tool_calls", id="required"),
    pytest.param(
        dict(messages=ASK, tools=[FORECAST, CLOCK], tool_choice="required", parallel_tool_calls=False),
        "tool_calls",
        id="required-one",
    ),
    pytest.param(
        dict(messages=ASK, tools=[FORECAST, CLOCK], tool_choice={"type": "function", "function": {"name": "clock"}}),
        "tool_calls",
        id="named",
    ),
    pytest.param(dict(OPEN_CALL_FIELDS, tool_choice="none"), "content", id="none"),
]


@pytest.mark.parametrize("fields,holds", PARITY)
def test_rest_and_grpc_read_the_same_reply_into_the_same_reasoning_content_and_tool_calls(mesh, fields, holds):
    """One request at temperature 0 over both edges: the same tokens, read by the same parsers into the same
    reasoning, content and tool calls (ids aside: each reply mints its own)."""
    body = {"model": MODEL_ID, "max_tokens": 96, "temperature": 0} | fields
    r = httpx.post(f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (choice,), usage = r.json()["choices"], r.json()["usage"]
    message = choice["message"]
    rest_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    rest = (message.get("reasoning_content") or "", message.get("content") or "", rest_calls)
    assert rest[("reasoning", "content", "tool_calls").index(holds)], rest
    messages, options = fields["messages"], {k: v for k, v in fields.items() if k != "messages"}
    with mesh.client() as grpc_client:
        result = grpc_client.generate(messages, max_tokens=96, temperature=0, **options)
    assert (result.reasoning, result.content, [(c.name, c.arguments) for c in result.tool_calls]) == rest
    assert result.finish_reason == choice["finish_reason"]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )

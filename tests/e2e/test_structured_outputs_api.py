"""Structured outputs at both edges of a real mesh (router, workers as processes), P/D (1P+1D) and colocated: the
`openai` client's response_format and vLLM's structured_outputs (extra_body) on chat and completions, streamed and
not, and the SDK's keywords over gRPC. Outputs follow their grammars (jsonschema, Python's re) and equal the
monolithic engine's; a bad schema, regex or grammar is a 400 (INVALID_ARGUMENT over gRPC) that says what is wrong,
and the mesh keeps serving."""

import json
import re

import jsonschema
import openai
import pytest
from harness import start_mesh

from deltamesh.client import InvalidRequest
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.protocol.structured import StructuredOutputs

pytestmark = [pytest.mark.e2e, pytest.mark.api]
MODEL_ID = DEFAULT_MODEL.name
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 640  # PERSON's longest output: 32 characters of whitespace in each of its 13 gaps, and the values


@pytest.fixture(scope="module", params=["1P+1D", "colocated"])
def mesh(request, tmp_path_factory):
    counts = {"prefill": 1, "decode": 1} if request.param == "1P+1D" else {"prefill": 0, "decode": 0, "colocated": 1}
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("structured"), http=True, **counts)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)


def reference(engine, prompt, spec, temperature=0.0, seed=None, max_tokens=MAX_TOKENS):
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, structured_outputs=spec)
    return engine.generate(prompt, params)[0]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 3)])
def test_chat_json_schema_validates_and_is_the_monolithic_engines(client, reference_engine, temperature, seed):
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    res = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        response_format=PERSON_FORMAT,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=seed,
    )
    text = res.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert res.choices[0].finish_reason == "stop"
    ref = reference(
        reference_engine,
        reference_engine.tokenizer.encode_chat(messages),
        StructuredOutputs(json=PERSON),
        temperature,
        seed,
    )
    assert text == ref.text


def test_streamed_json_schema_and_json_object(client):
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "A person, please."}],
        response_format=PERSON_FORMAT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"

    obj = client.completions.create(
        model=MODEL_ID,
        prompt="{",
        extra_body={"response_format": {"type": "json_object"}},  # not in OpenAI's completions API; vLLM takes it
        max_tokens=2048,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    pieces = list(obj)
    assert isinstance(json.loads("".join(p.choices[0].text for p in pieces)), dict)
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_completions_regex_and_choice_streamed_and_not(client, reference_engine):
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    for stream in (False, True):
        for body, check in (
            ({"structured_outputs": {"regex": pattern}}, lambda t: re.fullmatch(pattern, t)),
            ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
        ):
            res = client.completions.create(
                model=MODEL_ID,
                prompt="Answer:",
                max_tokens=32,
                temperature=1.0,
                seed=11,
                stream=stream,
                extra_body=body,
            )
            parts = list(res) if stream else [res]
            text = "".join(p.choices[0].text for p in parts)
            assert check(text) and parts[-1].choices[0].finish_reason == "stop"
            spec = StructuredOutputs(**body["structured_outputs"])
            assert text == reference(reference_engine, "Answer:", spec, 1.0, 11, 32).text


def test_grpc_takes_the_same_asks_as_rest(mesh, client):
    """The SDK's response_format and structured_outputs keywords: the same output as REST for the same ask."""
    ebnf = 'root ::= "(" [1-9] (" + " [1-9])* ")"'
    with mesh.client() as sdk:
        for keywords in ({"response_format": PERSON_FORMAT}, {"structured_outputs": {"grammar": ebnf}}):
            via_grpc = sdk.generate("Hello", max_tokens=MAX_TOKENS, temperature=1.0, seed=7, **keywords)
            rest = client.completions.create(
                model=MODEL_ID, prompt="Hello", max_tokens=MAX_TOKENS, temperature=1.0, seed=7, extra_body=keywords
            )
            assert via_grpc.text == rest.choices[0].text and via_grpc.finish_reason == "stop"


@pytest.mark.parametrize(
    "ask,message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "objec",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, r"invalid structured output regex: .*Unclosed"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "undefined_rule"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "non-empty list"),
        ({"extra_body": {"guided_regex": "a+"}}, "structured_outputs"),
    ],
)
def test_a_bad_spec_is_a_400_that_says_what_is_wrong_on_both_edges(mesh, client, ask, message):
    as_extra = {"extra_body": {**ask.get("extra_body", {}), **{k: v for k, v in ask.items() if k != "extra_body"}}}
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=8, **as_extra)
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=8, stream=True, **ask
        )
    if "response_format" in ask or "structured_outputs" in ask.get("extra_body", {}):
        keywords = ask if "response_format" in ask else ask["extra_body"]
        with mesh.client() as sdk, pytest.raises(InvalidRequest, match=message):
            sdk.generate("x", max_tokens=8, **keywords)
    ok = client.completions.create(model=MODEL_ID, prompt="still there", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"

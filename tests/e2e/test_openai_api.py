"""The REST gateway, driven by the official `openai` client (unmodified) and by raw HTTP for bad input."""

import json
from pathlib import Path

import httpx
import openai
import pytest
from harness import start_mesh

from deltamesh.engine import DEFAULT_MODEL, EngineConfig, SamplingParams
from deltamesh.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
MODEL_ID = DEFAULT_MODEL.name
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def thinking_reply(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a reply whose prompt opened a <think> block (Qwen3.5's format, thinking on):
    the text up to </think>, trimmed, and the rest without its leading blank lines (none without a </think>, which
    a random-weight model rarely writes)."""
    reasoning, closed, content = text.partition("</think>")
    return reasoning.strip() or None, (content.lstrip() or None) if closed else None


def chatml_model(directory: Path) -> Path:
    """The default model served with a plain ChatML template (its template before Qwen3.5's), for the tests of reuse
    across a conversation's turns: in Qwen3.5's format a turn does not extend the previous turn's sequence (the
    template drops the earlier reply's reasoning, and writes it back trimmed), so reuse stops at the earlier reply."""
    model = directory / DEFAULT_MODEL.name
    model.mkdir()
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "chat_template.jinja":
            (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text(CHATML)
    return model


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("rest"), http=True)
    yield m
    m.stop()


def test_models_and_completions(client, reference_engine):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    res = client.completions.create(model=MODEL_ID, prompt="The Python language", max_tokens=16, temperature=0)
    ref = reference_engine.generate("The Python language", SamplingParams(max_tokens=16, temperature=0))[0]
    assert res.choices[0].text == ref.text
    assert res.choices[0].finish_reason == ref.finish_reason.value
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == len(ref.token_ids)


def test_chat_uses_the_checkpoint_template(client, reference_engine):
    messages = [{"role": "user", "content": "What is a list?"}]
    res = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=12, temperature=0)
    ids = reference_engine.tokenizer.encode_chat(messages)
    ref = reference_engine.generate(ids, SamplingParams(max_tokens=12, temperature=0))[0]
    message = res.choices[0].message
    assert (message.reasoning_content, message.content) == thinking_reply(ref.text)
    assert message.role == "assistant"
    assert res.usage.prompt_tokens == len(ids)


def test_streaming_chat_with_usage(client, base_url):
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Tell me about tuples."}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)  # a field of vLLM's
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    full = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Tell me about tuples."}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (reasoning or None, text or None) == (
        full.choices[0].message.reasoning_content,
        full.choices[0].message.content,
    )
    # on the wire, only the first chunk names the role (the openai client reads a null one the same way)
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    sse = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30).text.splitlines()
    deltas = [json.loads(line[len("data: ") :])["choices"][0]["delta"] for line in sse if line.startswith("data: {")]
    assert deltas[0] == {"role": "assistant", "content": ""} and all("role" not in d for d in deltas[1:]), deltas


def test_stop_strings_n_and_logprobs(client):
    base = (
        client.completions.create(
            model=MODEL_ID, prompt="The Python language", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = base[8:11]
    res = client.completions.create(
        model=MODEL_ID,
        prompt="The Python language",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert res.choices[0].finish_reason == "stop" and res.choices[0].text == base[: base.index(stop)]

    kw = dict(
        model=MODEL_ID,
        prompt="A dictionary",
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    two = client.completions.create(**kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens == 24  # both choices
    assert (
        two.usage.prompt_tokens
        == client.completions.create(model=MODEL_ID, prompt="A dictionary", max_tokens=1).usage.prompt_tokens
    )  # counted once
    again = client.completions.create(**kw)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]  # seeded: reproducible

    lp = client.completions.create(model=MODEL_ID, prompt="A set", max_tokens=5, temperature=0, logprobs=3)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 5 and all(len(t) == 3 for t in logprobs.top_logprobs)
    assert all(v <= 0 for v in logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_bad_parameters_raise_the_right_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=10**7)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="", max_tokens=4)


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{not json", 400),
        (json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": "many"}).encode(), 400),
        (json.dumps({"model": MODEL_ID, "prompt": 12}).encode(), 400),
        (b'{"model": "' + MODEL_ID.encode() + b'", "prompt": "\xff\xfe"}', 400),  # invalid UTF-8
        (json.dumps({"model": MODEL_ID, "prompt": "x" * 200_000, "max_tokens": 4}).encode(), 400),  # over context
        (json.dumps({"model": MODEL_ID, "prompt": "x", "pad": "y" * (5 << 20)}).encode(), 413),
        (json.dumps({"model": MODEL_ID}).encode(), 400),  # no prompt (the model may be left out, as vLLM takes it)
    ],
)
def test_malformed_requests_get_4xx_in_openai_shape_and_the_mesh_keeps_serving(mesh, base_url, body, status):
    r = httpx.post(f"{base_url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    assert mesh.wait_idle() == {}


def test_chunked_oversized_body_is_refused(mesh, base_url):
    def chunks():
        yield b'{"model": "' + MODEL_ID.encode() + b'", "prompt": "x", "pad": "'
        for _ in range(5):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(
        f"{base_url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_health_ready_metrics_and_openapi(mesh, base_url, client):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base_url}/ready").status_code == 200
    schema = httpx.get(f"{base_url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("ChatCompletionRequest")

    def scrape(url):
        return {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in httpx.get(url).text.splitlines()
            if line and not line.startswith("#")
        }

    before = scrape(f"{base_url}/metrics")
    client.completions.create(model=MODEL_ID, prompt="Metrics move", max_tokens=5, temperature=0)
    after = scrape(f"{base_url}/metrics")
    assert after['deltamesh_router_requests_total{outcome="completed"}'] > before.get(
        'deltamesh_router_requests_total{outcome="completed"}', 0
    )
    assert (
        after["deltamesh_router_time_to_first_token_seconds_count"]
        > before["deltamesh_router_time_to_first_token_seconds_count"]
    )
    assert after["deltamesh_router_generation_tokens_total"] >= before["deltamesh_router_generation_tokens_total"] + 5


def test_client_disconnect_aborts_the_request_in_the_mesh(mesh, base_url):
    body = {"model": MODEL_ID, "prompt": "A long story", "max_tokens": 3000, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body | {"stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # leaving the block closes the connection mid-stream
    assert mesh.wait_idle() == {}
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=1.0)
    assert mesh.wait_idle() == {}


def test_a_json_body_without_a_json_content_type_is_told_so(base_url):
    body = json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 2})
    r = httpx.post(f"{base_url}/v1/completions", content=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_unknown_parameters_are_refused_as_openai_does_and_known_ones_pass(base_url):
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        base = {"model": MODEL_ID, "max_tokens": 2, **body}
        r = httpx.post(f"{base_url}{path}", json=base | {"foo_bar": 1}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["message"] == "Unrecognized request argument supplied: foo_bar", r.text
        assert err["param"] == "foo_bar" and err["type"] == "invalid_request_error"
        # OpenAI parameters that do not change the output, and a message field the server does not use
        ok = base | {"user": "u-1"}
        if "messages" in body:
            ok |= {
                "store": False,
                "metadata": {"k": "v"},
                "messages": [{"role": "user", "content": "x", "refusal": None}],
            }
        r = httpx.post(f"{base_url}{path}", json=ok, timeout=60)
        assert r.status_code == 200, r.text


def test_null_means_the_default_and_dependent_parameters_are_checked(base_url, client):
    """Clients that send every field send null for those unset: null is the default (as OpenAI and vLLM take
    it). Parameters that need another one (stream_options needs stream, top_logprobs needs logprobs) and empty
    stop strings are refused naming the parameter. A model is described under its id, as openai's
    models.retrieve asks."""
    nulls = {"n": None, "stream": None, "stop": None, "seed": None, "temperature": 0}
    for path, body in (
        ("/v1/completions", {"prompt": "x", "echo": None, "logprobs": None}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": None, "top_logprobs": None},
        ),
    ):
        r = httpx.post(f"{base_url}{path}", json={"model": MODEL_ID, "max_tokens": 2, **nulls, **body}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    chat = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    for path, body, param in (
        ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "stop": ""}, "stop"),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "x", "stop": ["a", ""]}, "stop"),
        (
            "/v1/completions",
            {"model": MODEL_ID, "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/chat/completions", chat | {"top_logprobs": 2}, "top_logprobs"),
    ):
        r = httpx.post(f"{base_url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("field,value", [("temperature", 5), ("top_p", 0), ("top_k", -2), ("min_p", 2), ("seed", -3)])
def test_rest_and_grpc_refuse_a_bad_value_with_the_same_message(mesh, base_url, field, value):
    from deltamesh.client import InvalidRequest

    with pytest.raises(ValueError) as shared:  # the engine's own check, which the router runs for gRPC requests
        SamplingParams(**{field: value}).validate(vocab_size=1)
    r = httpx.post(
        f"{base_url}/v1/completions", json={"model": MODEL_ID, "prompt": "x", "max_tokens": 2, field: value}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"] == {
        "message": str(shared.value),
        "type": "invalid_request_error",
        "param": field,
        "code": None,
    }, r.text
    if value < 0:
        return  # an unsigned field on the wire: the SDK cannot even encode a negative value
    with mesh.client() as grpc_client, pytest.raises(InvalidRequest) as e:
        grpc_client.generate("x", max_tokens=2, **{field: value})
    assert str(shared.value) in str(e.value), (str(shared.value), str(e.value))


def chat_like_the_reference(
    mesh, reference_engine, messages: list[dict], questions: list[str], model: Path
) -> list[tuple[int, int, int]]:
    """Ask each question in turn through the mesh's REST gateway, the whole conversation every time; each answer
    must be the monolithic engine's (same weights; the mesh serves `model`, a chatml_model). Returns (prompt tokens,
    reply tokens, cached prompt tokens) per turn."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)
    tokenizer = Tokenizer(model)
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        ids = tokenizer.encode_chat(messages)
        ref = reference_engine.generate(ids, SamplingParams(max_tokens=24, temperature=0))[0]
        res = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24, temperature=0)
        assert res.choices[0].message.content == ref.text
        messages.append({"role": "assistant", "content": ref.text})
        turns.append((len(ids), len(ref.token_ids), res.usage.prompt_tokens_details.cached_tokens))
    return turns


@pytest.mark.parametrize("layout", ["colocated", "1P+1D", "1P+1D direct"])
def test_a_four_turn_chat_with_the_prefix_cache_equals_it_without(tmp_path, reference_engine, layout):
    """Each turn re-sends the whole conversation. With --prefix-cache the answers are the monolithic engine's
    (no cache). A colocated worker computes only each turn's new message (the previous prompt and reply come
    from its cache). Under 1P+1D the prefill worker reuses the previous turns' prompts (the replies were decoded
    on the other worker, so it computes them); with the router's P/D decider (--pd-direct-max-tokens) the later
    turns skip the prefill worker and go to the decode worker that holds the conversation."""
    counts = dict(prefill=0, decode=0, colocated=1) if layout == "colocated" else {}
    router_args = ["--pd-direct-max-tokens", "64"] if layout.endswith("direct") else []
    model = chatml_model(tmp_path)
    m = start_mesh(str(model), tmp_path, worker_args=["--prefix-cache"], router_args=router_args, http=True, **counts)
    try:
        questions = ["What is a list?", "And a tuple?", "Which one is faster?", "Thanks. What about sets?"]
        prompts, replies, cached = zip(*chat_like_the_reference(m, reference_engine, [], questions, model))
        earlier = sum(p + r - 1 for p, r in zip(prompts[:-1], replies[:-1]))  # all but each last reply token
        hits = {role: [w.load().prefix_cache_hit_tokens for w in m.workers(role)] for role in ("prefill", "decode")}
        if layout == "colocated":
            [worker] = m.workers("colocated")
            assert worker.load().prefix_cache_hit_tokens >= earlier
        elif layout == "1P+1D":  # the previous prompts, up to their last page boundary
            page = EngineConfig(model=str(DEFAULT_MODEL)).page_size
            assert sum((p - 1) // page * page for p in prompts[:-1]) <= hits["prefill"][0] < earlier
        else:
            assert hits["prefill"] == [0] and hits["decode"][0] >= earlier
        # each turn's usage reports the hit of the worker that computed its prompt: theirs add up to the workers'
        assert cached[0] == 0 and sum(cached) == sum(w.load().prefix_cache_hit_tokens for w in m.workers())
        assert m.wait_idle() == {}
    finally:
        m.stop()


def test_a_decode_worker_that_lost_the_conversation_refuses_and_prefill_serves_it(tmp_path, reference_engine):
    """The P/D decider sends turn 2 to the decode worker that finished turn 1, but that worker's cache keeps
    almost nothing (--prefix-cache-pages 1): it refuses rather than prefill the whole prompt itself, and the
    request goes through the prefill worker, with the same answer."""
    model = chatml_model(tmp_path)
    m = start_mesh(
        str(model),
        tmp_path,
        worker_args=["--prefix-cache"],
        http=True,
        role_args={"decode": ["--prefix-cache-pages", "1"]},
        router_args=["--pd-direct-max-tokens", "64"],
    )
    try:
        system = {"role": "system", "content": "You answer questions about Python in short sentences. " * 8}
        chat_like_the_reference(m, reference_engine, [system], ["What is a list?", "And a tuple?"], model)
        metrics = httpx.get(f"http://127.0.0.1:{m.http_port}/metrics").text
        assert 'deltamesh_router_pd_decisions_total{path="refused"} 1.0' in metrics
        [prefill] = m.workers("prefill")
        assert prefill.load().prefix_cache_hit_tokens > 0  # turn 2 was prefilled there, from turn 1's prompt
        assert m.wait_idle() == {}
    finally:
        m.stop()

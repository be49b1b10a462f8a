"""The sampling fields a vLLM or OpenAI client sends, at both edges of a real P/D mesh (router + prefill + decode
processes): each penalty, logit_bias and min_tokens gives the monolithic engine's tokens over REST and gRPC alike
(the decode worker rebuilding its counts from the prompt and the first token), bad values get the same message at
both edges, `vllm bench serve`'s exact payloads are served, vLLM's extensions keep their meaning,
--served-model-name names the model, and the router process runs without torch."""

import json
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from harness import start_mesh
from test_openai_api import thinking_reply

from deltamesh.client import InvalidRequest
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.v1 import router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.api]
NAMES = ["qwen-alias", "second-name"]
PROMPT = "The Python language"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(
        str(DEFAULT_MODEL), tmp_path_factory.mktemp("api"), http=True, router_args=["--served-model-name", *NAMES]
    )
    yield m
    m.stop()


@pytest.fixture(scope="module")
def eos(reference_engine):
    return min(reference_engine.core.request_builder.eos_token_ids)


def cases(eos: int) -> list[dict]:
    return [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=2.0, logit_bias={297: 9.0}),  # the biased token until its count outweighs the bias
        dict(presence_penalty=-0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        dict(logit_bias={42: 4.0, 201: -100.0}),
        dict(min_tokens=3, logit_bias={eos: 100.0}),  # end-of-sequence held back for 3 tokens, then at once
    ]


def test_each_field_over_rest_and_grpc_gives_the_monolithic_engines_tokens(mesh, client, reference_engine, eos):
    for case in cases(eos):
        sampling = dict(max_tokens=12, temperature=0, **case)
        ref = reference_engine.generate(PROMPT, SamplingParams(**sampling))[0]
        with mesh.client() as grpc_client:
            via_grpc = grpc_client.generate(PROMPT, **sampling)
        native = {k: case[k] for k in ("presence_penalty", "frequency_penalty", "logit_bias") if k in case}
        extra = {k: v for k, v in case.items() if k not in native}
        native["logit_bias"] = {str(t): b for t, b in native.get("logit_bias", {}).items()} or None
        rest = client.completions.create(
            model=NAMES[0], prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra, **native
        ).choices[0]
        assert via_grpc.token_ids == ref.token_ids, case
        assert rest.text == via_grpc.text == ref.text and rest.finish_reason == ref.finish_reason.value, case
    assert ref.token_ids[:3].count(eos) == 0 and ref.token_ids[3:] == [eos]  # the min_tokens case, last


def test_chat_and_n_choices_with_penalties(client, reference_engine):
    messages = [{"role": "user", "content": "What is a list?"}]
    kw = dict(temperature=0, presence_penalty=1.0, frequency_penalty=0.5)
    chat = client.chat.completions.create(
        model=NAMES[1], messages=messages, max_completion_tokens=10, extra_body={"repetition_penalty": 1.2}, **kw
    )
    ids = reference_engine.tokenizer.encode_chat(messages)
    ref = reference_engine.generate(ids, SamplingParams(max_tokens=10, repetition_penalty=1.2, **kw))[0]
    message = chat.choices[0].message  # Qwen3.5's format: thinking is on, the reply starts in a <think> block
    assert (message.reasoning_content, message.content) == thinking_reply(ref.text)
    # n choices are requests of their own, each with its counts: choice i is seed + i's sampling
    res = client.completions.create(
        model=NAMES[0], prompt=PROMPT, max_tokens=10, temperature=1.0, n=2, seed=7, frequency_penalty=1.0
    )
    for i, choice in enumerate(res.choices):
        p = SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i, frequency_penalty=1.0)
        assert choice.text == reference_engine.generate(PROMPT, p)[0].text


@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("min_tokens", 5),  # over max_tokens
        ("min_tokens", -1),
        ("logit_bias", {"999999": 1.0}),
        ("logit_bias", {"5": 100.5}),
        ("logit_bias", {str(i): 1.0 for i in range(301)}),
        ("top_k", -2),
    ],
)
def test_rest_and_grpc_refuse_a_bad_value_with_the_same_message(mesh, base_url, field, value):
    body = {"model": NAMES[0], "prompt": "x", "max_tokens": 2, field: value}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and error["type"] == "invalid_request_error", r.text
    if (isinstance(value, (int, float)) and value < 0 and field in ("min_tokens", "top_k")) or field == "top_k":
        return  # an unsigned field on the wire: the SDK cannot even encode it
    grpc_value = {int(k): v for k, v in value.items()} if field == "logit_bias" else value
    with mesh.client() as grpc_client, pytest.raises(InvalidRequest) as e:
        grpc_client.generate("x", max_tokens=2, **{field: grpc_value})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error["message"] in str(e.value), (error["message"], str(e.value))


def vllm_stream(base_url: str, path: str, payload: dict) -> tuple[str, int, int]:
    """What `vllm bench serve` reads from a stream (vllm/benchmarks/lib/endpoint_request_func.py): the text of the
    chunks with choices (the first one is its TTFT), then the usage chunk's completion tokens."""
    headers = {"Content-Type": "application/json", "x-request-id": f"bench-{uuid.uuid4().hex[:8]}-0"}
    text, chunks, completion_tokens = "", 0, None
    with httpx.stream("POST", f"{base_url}{path}", json=payload, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line.removeprefix("data: "))
            if choices := data.get("choices"):
                chunks += 1
                piece = choices[0]["text"] if "text" in choices[0] else choices[0]["delta"].get("content")
                text += piece or ""
            elif usage := data.get("usage"):
                completion_tokens = usage["completion_tokens"]
    return text, chunks, completion_tokens


def test_vllm_bench_serve_payloads_are_served_as_they_are(base_url, reference_engine):
    """The payloads exactly as `vllm bench serve` builds them (its defaults, --ignore-eos, and the sampling flags
    it puts in every request), text and token-id prompts, completions and chat, streamed with usage."""
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    assert models[0]["id"] == NAMES[0] and models[0]["root"] == str(DEFAULT_MODEL)  # what the bench reads
    sampling_flags = dict(temperature=0.0, top_p=0.9, top_k=-1, min_p=0.05, frequency_penalty=0.5)
    sampling_flags |= dict(presence_penalty=0.5, repetition_penalty=1.1)
    ids = reference_engine.tokenizer.encode(PROMPT)
    for prompt in (PROMPT, ids):
        payload = {
            "model": NAMES[0],
            "prompt": prompt,
            "repetition_penalty": 1.0,
            "max_tokens": 8,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for extra in ({"ignore_eos": True}, {"ignore_eos": True, **sampling_flags}):
            text, chunks, completion_tokens = vllm_stream(base_url, "/v1/completions", payload | extra)
            p = (
                SamplingParams(max_tokens=8, ignore_eos=True, **{**sampling_flags, "top_k": 0})
                if len(extra) > 1
                else None
            )
            assert completion_tokens == 8 and chunks >= 1
            if p is not None:
                assert text == reference_engine.generate(prompt, p)[0].text
    chat = {
        "model": NAMES[0],
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    for extra in ({}, sampling_flags):
        text, chunks, completion_tokens = vllm_stream(base_url, "/v1/chat/completions", chat | extra)
        assert completion_tokens == 8 and chunks >= 2  # the role's chunk, then the text


def test_vllm_extensions_keep_their_meaning_and_unknown_ones_are_refused(client, base_url, reference_engine, eos):
    greedy = dict(model=NAMES[0], prompt=PROMPT, max_tokens=20, temperature=0)
    base = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    kept = client.completions.create(
        **greedy, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == base[: base.index(stop) + len(stop)] and kept.finish_reason == "stop"
    # the end-of-sequence token's own text, kept with skip_special_tokens false and include_stop_str_in_output
    special = {"logit_bias": {eos: 100.0}, "min_tokens": 1}
    eos_text = reference_engine.tokenizer.decode([eos], skip_special_tokens=False)
    shown = client.completions.create(
        **greedy,
        extra_body={**special, "skip_special_tokens": False, "include_stop_str_in_output": True},
    )
    hidden = client.completions.create(**greedy, extra_body=special)
    assert shown.choices[0].text.endswith(eos_text) and not hidden.choices[0].text.endswith(eos_text)
    chat = client.chat.completions.create(
        model=NAMES[0],
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        extra_body={"top_k": -1, "min_p": 0.1, "ignore_eos": True, "spaces_between_special_tokens": False},
    )
    assert chat.usage.completion_tokens == 5
    r = httpx.post(f"{base_url}/v1/completions", json={**greedy, "use_beam_search": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search", r.text  # default only
    r = httpx.post(f"{base_url}/v1/completions", json={**greedy, "prompt_logprobs": 1}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) > 1, r.text


def test_served_model_names_and_the_checkpoint_path_name_the_model(mesh, client, base_url):
    assert [m.id for m in client.models.list().data] == [NAMES[0]]
    for name in (*NAMES, str(DEFAULT_MODEL)):
        assert client.completions.create(model=name, prompt="x", max_tokens=2).choices[0].text is not None
        assert client.models.retrieve(name).id == NAMES[0]
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)  # as vLLM
    assert r.status_code == 200, r.text
    for other in (DEFAULT_MODEL.name, "no-such-model"):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=other, prompt="x", max_tokens=2)
    with grpc.insecure_channel(mesh.router_address) as channel:
        [model] = router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=10).models
    assert model.id == NAMES[0] and model.root == str(DEFAULT_MODEL)
    with mesh.client() as grpc_client:
        assert grpc_client.generate("x", max_tokens=2, model=NAMES[1]).token_ids
        with pytest.raises(Exception, match="not served here"):
            grpc_client.generate("x", max_tokens=2, model="no-such-model")


def test_the_router_process_runs_without_torch(mesh):
    """The started router, not only its imports: no torch library is mapped into the process."""
    [router] = [p for p in mesh.procs if p.role == "router"]
    maps = Path(f"/proc/{router.popen.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    workers = [p for p in mesh.procs if p.role != "router"]
    assert "libtorch" in Path(f"/proc/{workers[0].popen.pid}/maps").read_text()  # the check sees torch where it is

"""What users arriving from vLLM send and read beyond OpenAI's API: the reasoning under both names, stop_reason,
return_token_ids, continuous usage stats, truncate_prompt_tokens, request_id, completions' logprobs (the sampled
token and the top k, up to 20), and vLLM's and OpenAI's parameters accepted at their defaults only."""

import json

import httpx
import pytest
from harness import start_mesh

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
MODEL_ID = DEFAULT_MODEL.name
PROMPT_IDS = [1000 + 7 * i for i in range(40)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("vllm-ext"), http=True)
    yield m
    m.stop()


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL_ID, **body}, timeout=60)


def events(base_url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base_url}{path}", json={"model": MODEL_ID, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def greedy(prompt, n_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, **extra}


CHAT = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8, "temperature": 0}


def a_stop_string(text: str) -> str:
    """Three characters from the second half of `text`, without blanks at either end."""
    for i in range(len(text) // 2, len(text) - 2):
        window = text[i : i + 3]
        if window == window.strip():
            return window
    raise AssertionError(f"no stop string in {text!r}")


def test_reasoning_comes_under_both_names(base_url):
    """Qwen3.5's template opens a <think> block, so the reply starts as reasoning: vLLM's `reasoning` and the older
    `reasoning_content` carry it alike, whole and streamed; include_reasoning false drops both."""
    message = post(base_url, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    assert message["reasoning"] and message["reasoning"] == message["reasoning_content"], message
    deltas = [c["choices"][0]["delta"] for c in events(base_url, "/v1/chat/completions", CHAT) if c["choices"]]
    streamed = "".join(d.get("reasoning", "") for d in deltas)
    assert streamed == "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning"]
    off = post(base_url, "/v1/chat/completions", CHAT | {"include_reasoning": False}).json()["choices"][0]["message"]
    assert off["reasoning"] is None and off["reasoning_content"] is None


def test_stop_reason_names_the_stop_string_or_token(base_url):
    whole = post(base_url, "/v1/completions", greedy(PROMPT_IDS, 12, return_token_ids=True)).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["stop_reason"] is None
    ids, text = whole["token_ids"], whole["text"]
    stop_id = ids[5]
    by_token = post(base_url, "/v1/completions", greedy(PROMPT_IDS, 12, stop_token_ids=[stop_id])).json()
    choice = by_token["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id, choice
    stop = a_stop_string(text)  # greedy again, the text holds it
    got = post(base_url, "/v1/completions", greedy(PROMPT_IDS, 12, stop=[stop])).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop, got
    reasoning = post(base_url, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["reasoning"]
    chat_stop = a_stop_string(reasoning)
    got = post(base_url, "/v1/chat/completions", CHAT | {"stop": [chat_stop]}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == chat_stop, got
    last = [c for c in events(base_url, "/v1/completions", greedy(PROMPT_IDS, 12, stop=[stop])) if c["choices"]][-1]
    assert last["choices"][0]["stop_reason"] == stop and last["choices"][0]["finish_reason"] == "stop", last


def test_return_token_ids_whole_and_streamed(base_url):
    tokenizer = Tokenizer(DEFAULT_MODEL)
    body = greedy("The tokenizer of this model", 10, return_token_ids=True, ignore_eos=True)
    choice = post(base_url, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("The tokenizer of this model")
    assert len(choice["token_ids"]) == 10 and tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = [c["choices"][0] for c in events(base_url, "/v1/completions", body) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    # without it, no token id field at all (OpenAI's shape)
    plain = post(base_url, "/v1/completions", greedy("The tokenizer of this model", 3)).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    chat = post(base_url, "/v1/chat/completions", CHAT | {"return_token_ids": True}).json()
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = events(base_url, "/v1/chat/completions", CHAT | {"return_token_ids": True})
    assert streamed[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in streamed for ch in c["choices"] for t in ch.get("token_ids", [])] == chat["choices"][0][
        "token_ids"
    ]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", greedy("Count with me", 6, n=2, ignore_eos=True)),
        ("/v1/chat/completions", CHAT | {"ignore_eos": True}),
    ],
)
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(base_url, path, body):
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(base_url, path, body | opts)
    *per_token, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == body.get("n", 1) * body["max_tokens"]
    seen: dict[int, int] = {}
    for c in per_token:
        (choice,) = c["choices"]
        used = c["usage"]
        assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"] > 0, c
        assert used["completion_tokens"] >= seen.get(choice["index"], 0)
        seen[choice["index"]] = used["completion_tokens"]
    assert set(seen.values()) == {body["max_tokens"]}
    # include_usage alone: usage only at the end; and stream_options takes no unknown key
    plain = events(base_url, path, body | {"stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] is not None
    r = post(base_url, path, body | {"stream": True, "stream_options": {"include_usage": True, "typo": 1}})
    assert r.status_code == 400, r.text


def test_completion_logprobs_hold_the_sampled_token_and_the_top_k(base_url):
    for k in (0, 3, 20):
        lp = post(base_url, "/v1/completions", greedy(PROMPT_IDS, 5, logprobs=k, temperature=1.0, seed=7)).json()
        lp = lp["choices"][0]["logprobs"]
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert next(iter(top.items())) == (token, logprob), top  # the sampled token first
            # the top k may hold the sampled token, and tokens of one text (byte pieces) share one entry
            assert len(top) <= k + 1 and len(top) >= min(k, 3), top
    r = post(base_url, "/v1/completions", greedy("x", 2, logprobs=21))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_truncate_prompt_tokens_keeps_the_prompts_end(base_url):
    cut = post(base_url, "/v1/completions", greedy(PROMPT_IDS, 6, truncate_prompt_tokens=10)).json()
    short = post(base_url, "/v1/completions", greedy(PROMPT_IDS[-10:], 6)).json()
    assert cut["usage"]["prompt_tokens"] == 10 and cut["choices"][0]["text"] == short["choices"][0]["text"]
    chat = post(base_url, "/v1/chat/completions", CHAT | {"truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5, chat
    models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]
    too_long = [5] * (models["max_model_len"] + 3)
    r = post(base_url, "/v1/completions", greedy(too_long, 2))
    assert r.status_code == 400, r.text
    r = post(base_url, "/v1/completions", greedy(too_long, 2, truncate_prompt_tokens=100))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100, r.text
    for bad in (0, -2, models["max_model_len"] + 1):
        r = post(base_url, "/v1/completions", greedy(PROMPT_IDS, 2, truncate_prompt_tokens=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_request_id_names_the_answer(base_url):
    for _ in range(2):  # the same id again once the first has ended
        r = post(base_url, "/v1/completions", greedy("x", 2, request_id="trace-42.a:b"))
        assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-42.a:b", r.text
    assert post(base_url, "/v1/chat/completions", CHAT | {"request_id": "t-1"}).json()["id"] == "chatcmpl-t-1"
    # while one runs, its id is taken (as over gRPC)
    most = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["max_model_len"] - 1
    long = {"model": MODEL_ID, "stream": True} | greedy("x", most, ignore_eos=True, request_id="busy")
    with httpx.stream("POST", f"{base_url}/v1/completions", json=long, timeout=60) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped reader closes the stream, which aborts the request
        next(lines)
        r = post(base_url, "/v1/completions", greedy("x", 2, request_id="busy"))
        assert r.status_code == 409, r.text
    for bad in ("has space", "x" * 200, ""):
        r = post(base_url, "/v1/completions", greedy("x", 2, request_id=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text


# what vLLM's own request types send by default (its clients send every field), and OpenAI's service parameters
VLLM_DEFAULTS = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "priority": 0,
    "prompt_logprobs": None,
    "bad_words": [],
    "allowed_token_ids": None,
    "cache_salt": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "return_tokens_as_token_ids": False,
    "add_special_tokens": True,
}
CHAT_DEFAULTS = {
    "echo": False,
    "chat_template": None,
    "documents": None,
    "modalities": ["text"],
    "functions": None,
    "prompt_cache_key": "tenant-1",
    "safety_identifier": "user-1",
    "reasoning_effort": "low",
}


def test_vllm_and_openai_parameters_pass_at_their_defaults_and_are_refused_otherwise(base_url):
    assert post(base_url, "/v1/completions", greedy("x", 2, **VLLM_DEFAULTS)).status_code == 200
    r = post(base_url, "/v1/chat/completions", CHAT | VLLM_DEFAULTS | CHAT_DEFAULTS | {"add_special_tokens": False})
    assert r.status_code == 200, r.text
    for path, body, param in (
        ("/v1/completions", greedy("x", 2, use_beam_search=True), "use_beam_search"),
        ("/v1/completions", greedy("x", 2, priority=1), "priority"),
        ("/v1/completions", greedy("x", 2, bad_words=["a"]), "bad_words"),
        ("/v1/completions", greedy("x", 2, cache_salt="s"), "cache_salt"),
        ("/v1/chat/completions", CHAT | {"chat_template": "{{ x }}"}, "chat_template"),
        ("/v1/chat/completions", CHAT | {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", CHAT | {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", CHAT | {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ):
        r = post(base_url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_is_bounded_by_the_routers_max_choices_only(base_url):
    """As vLLM: n has no bound of its own (RL rollouts ask for dozens); prompts x n stays under --max-choices."""
    r = post(base_url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 24, "seed": 1})
    assert r.status_code == 200 and sorted(c["index"] for c in r.json()["choices"]) == list(range(24)), r.text
    r = post(base_url, "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 2, "n": 513})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text

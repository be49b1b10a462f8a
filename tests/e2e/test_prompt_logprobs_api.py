"""Prompt logprobs through the mesh (a prefill and a decode worker: the prefill worker computes them), against
transformers' own model: completions' `echo` with `logprobs` as lm-eval's loglikelihood tasks send it (token-id
prompts in a batch, max_tokens 1, logprobs 1) and with max_tokens 0, vLLM's `prompt_logprobs` on completions and
chat, the gRPC SDK's, and the errors vLLM gives for what cannot be served."""

import json

import httpx
import pytest
import torch
from harness import start_mesh
from transformers import AutoModelForCausalLM

from deltamesh.engine import DEFAULT_MODEL
from deltamesh.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
MODEL_ID = DEFAULT_MODEL.name
PROMPTS = [[1000 + 7 * i for i in range(40)], [2000 + 13 * i for i in range(23)]]
TOL = 2e-4


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("prompt-logprobs"), http=True)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEFAULT_MODEL)


def reference(hf, ids) -> torch.Tensor:
    """[len(ids), vocab] float64 log-softmax of transformers' logits at each position."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL_ID, **body}, timeout=60)


def lm_eval_loglikelihood(base_url: str, prompts, max_tokens: int = 1) -> list[dict]:
    """The body lm-eval's local-completions model sends for loglikelihood requests."""
    body = {"prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True}
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return sorted(r.json()["choices"], key=lambda c: c["index"])


def test_echo_with_logprobs_gives_each_prompt_tokens_logprob(base_url, hf, tokenizer):
    for choice, ids in zip(lm_eval_loglikelihood(base_url, PROMPTS), PROMPTS):
        lp, want = choice["logprobs"], reference(hf, ids)
        n = len(ids)
        assert len(lp["token_logprobs"]) == n + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, n):
            assert lp["token_logprobs"][pos] == pytest.approx(want[pos - 1, ids[pos]].item(), abs=TOL), pos
            top = lp["top_logprobs"][pos]
            # lm-eval's greedy check: the token's logprob against the best of the top dict (the token, top 1)
            best = want[pos - 1].argmax().item()
            assert max(top.values()) == pytest.approx(want[pos - 1, best].item(), abs=TOL)
        generated = choice["logprobs"]["tokens"][n]
        assert lp["token_logprobs"][n] == pytest.approx(want[n - 1].max().item(), abs=TOL)  # greedy: the best
        prompt_text = tokenizer.decode(ids, skip_special_tokens=False)
        assert choice["text"] == prompt_text + generated and "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"][n] == len(prompt_text)


def test_a_second_round_from_a_warm_cache_gives_the_same(base_url):
    """The prompts are cached now; a request for their logprobs computes them again (and so equals the first, to
    float rounding: the two rounds' prompts need not share steps the same way)."""
    first = lm_eval_loglikelihood(base_url, PROMPTS)
    again = lm_eval_loglikelihood(base_url, PROMPTS)
    for a, b in zip(again, first):
        got, want = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
        assert len(got) == len(want) and got[0] is None and want[0] is None
        assert got[1:] == pytest.approx(want[1:], abs=TOL)


def test_echo_with_max_tokens_0_gives_the_prompt_alone(base_url, tokenizer):
    for choice, ids in zip(lm_eval_loglikelihood(base_url, PROMPTS, max_tokens=0), PROMPTS):
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=False)
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    text = post(base_url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 0, "echo": True}).json()
    assert text["choices"][0]["text"] == "Hello there"


def test_echo_streams_the_prompt_first(base_url, tokenizer):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json={"model": MODEL_ID, **body}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(tokenizer.decode(PROMPTS[0], skip_special_tokens=False))
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(PROMPTS[0]) + 1  # the prompt and the first token
    whole = post(base_url, "/v1/completions", {**body, "stream": False}).json()["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]


def check_vllm_entries(entries, ids, want, k, tokenizer):
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry, row = entries[pos], want[pos - 1]
        mine = entry[str(ids[pos])]
        assert mine["logprob"] == pytest.approx(row[ids[pos]].item(), abs=TOL)
        assert mine["rank"] == int((row > row[ids[pos]]).sum()) + 1
        assert mine["decoded_token"] == tokenizer.decode([ids[pos]], skip_special_tokens=False)
        top = row.topk(k).indices.tolist()
        assert all(str(t) in entry for t in top) and len(entry) in (k, k + 1)


def test_vllm_prompt_logprobs_on_completions_and_chat(base_url, hf, tokenizer):
    ids = PROMPTS[1]
    r = post(base_url, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_vllm_entries(choice["prompt_logprobs"], ids, reference(hf, ids), 3, tokenizer)
    assert choice["logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 3, "prompt_logprobs": 2}
    body = post(base_url, "/v1/chat/completions", {**chat, "return_token_ids": True}).json()
    chat_ids = body["prompt_token_ids"]
    assert body["usage"]["prompt_tokens"] == len(chat_ids)
    check_vllm_entries(body["prompt_logprobs"], chat_ids, reference(hf, chat_ids), 2, tokenizer)


def test_the_sdk_returns_them_too(mesh, hf):
    ids = PROMPTS[0]
    with mesh.client() as c:
        result = c.generate(ids, max_tokens=2, temperature=0, prompt_logprobs=1)
    want = reference(hf, ids)
    assert len(result.prompt_logprobs) == len(ids) - 1
    for pos, lp in enumerate(result.prompt_logprobs, start=1):
        assert lp.token_id == ids[pos] and lp.logprob == pytest.approx(want[pos - 1, ids[pos]].item(), abs=TOL)
        assert lp.rank == int((want[pos - 1] > want[pos - 1, ids[pos]]).sum()) + 1 and len(lp.top) == 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_cannot_be_served_is_refused(base_url, body, param):
    r = post(base_url, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param

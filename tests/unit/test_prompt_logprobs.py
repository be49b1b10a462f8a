"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' own models: each prompt token's logprob
given the tokens before it, its rank and the top k, whatever the chunking, beside other requests, with the prefix
cache on (a request that asks never starts from it), after a preemption, with async scheduling and speculative
decoding."""

import pytest
import torch
from hf_checkpoints import VOCAB, load_hf
from idle_pools import assert_idle

from deltamesh.engine import EngineConfig, RequestError, SamplingParams
from deltamesh.engine.core import EngineCore

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf_model, ids, k):
    """transformers' entries for prompt tokens 1..n-1: (token, logprob, rank, top k ids)."""
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1)
    out = []
    for pos in range(len(ids) - 1):
        row, token = lp[pos], ids[pos + 1]
        out.append((token, row[token].item(), int((row > row[token]).sum()) + 1, row.topk(k).indices.tolist()))
    return out


def run(core, asks):
    """asks: (request id, prompt, params); the first output's prompt logprobs and each one's outputs."""
    firsts, tokens, finals = {}, {}, {}

    def sink(out):
        if out.prompt_logprobs is not None:
            assert out.request_id not in firsts, "prompt logprobs come once, with the first token"
            firsts[out.request_id] = out.prompt_logprobs
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out

    for rid, ids, params in asks:
        core.submit(core.make_request(ids, params, rid), sink)
    while len(finals) < len(asks):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    return firsts, tokens, finals


def check(got, want, k):
    assert len(got) == len(want)
    for pos, (entry, (token, logprob, rank, top)) in enumerate(zip(got, want)):
        assert entry.token_id == token, pos
        assert entry.logprob == pytest.approx(logprob, abs=2e-4), pos
        assert entry.rank == rank, pos
        assert [t for t, _ in entry.top] == top and len(entry.top) == k, pos


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_match_transformers_across_chunks_and_beside_others(hf_checkpoints, family, async_scheduling):
    path = hf_checkpoints[family]
    core = EngineCore(
        EngineConfig(
            model=str(path), page_size=4, max_num_seqs=4, max_num_batched_tokens=24, async_scheduling=async_scheduling
        )
    )
    long, short = prompt(61, 1), prompt(9, 2)
    asks = [
        ("long", long, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)),
        ("plain", prompt(40, 3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        ("short", short, SamplingParams(max_tokens=2, temperature=0.8, seed=1, ignore_eos=True, prompt_logprobs=0)),
        ("one", [7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)),
    ]
    firsts, tokens, _ = run(core, asks)
    hf = load_hf(path)
    check(firsts["long"], reference(hf, long, 3), 3)
    check(firsts["short"], reference(hf, short, 0), 0)
    assert firsts["one"] == [] and "plain" not in firsts
    # the tokens are those of a run without prompt logprobs
    plain = EngineCore(EngineConfig(model=str(path), page_size=4, max_num_seqs=4, max_num_batched_tokens=24))
    _, alone, _ = run(
        plain, [(rid, ids, SamplingParams(**{**vars(p), "prompt_logprobs": None})) for rid, ids, p in asks]
    )
    assert tokens == alone
    assert_idle(core)


def test_a_request_that_asks_never_starts_from_the_prefix_cache(hf_checkpoints):
    path = hf_checkpoints["qwen3_5"]
    core = EngineCore(EngineConfig(model=str(path), page_size=4, max_num_batched_tokens=32))
    ids = prompt(50, 4)
    asking = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    first, _, finals = run(core, [("a", ids, asking)])
    again, _, finals2 = run(core, [("b", ids, asking)])
    _, _, plain = run(core, [("c", ids, SamplingParams(max_tokens=2, temperature=0))])
    assert finals["a"].num_cached_tokens == finals2["b"].num_cached_tokens == 0
    assert plain["c"].num_cached_tokens > 0  # the cache holds the prompt: the asking requests passed it by
    check(again["b"], reference(load_hf(path), ids, 1), 1)
    assert [(e.token_id, e.logprob) for e in first["a"]] == [(e.token_id, e.logprob) for e in again["b"]]


def test_prompt_logprobs_survive_a_preemption(hf_checkpoints):
    path = hf_checkpoints["qwen3_5"]
    core = EngineCore(EngineConfig(model=str(path), page_size=4, num_kv_pages=24, max_num_batched_tokens=16))
    ps = [prompt(12 + 3 * i, 10 + i) for i in range(6)]
    asks = [
        (f"r{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=2))
        for i, p in enumerate(ps)
    ]
    firsts, _, _ = run(core, asks)
    assert core.scheduler.num_preemptions > 0
    hf = load_hf(path)
    for i, p in enumerate(ps):
        check(firsts[f"r{i}"], reference(hf, p, 2), 2)
    assert_idle(core)


def test_speculative_engine_gives_the_same_prompt_logprobs(hf_checkpoints):
    path = hf_checkpoints["qwen3_5_moe"]  # (the test checkpoints carry MTP modules)
    core = EngineCore(
        EngineConfig(model=str(path), page_size=4, max_num_batched_tokens=16, speculative_tokens=2, max_num_seqs=4)
    )
    ids = prompt(37, 5)
    firsts, _, _ = run(core, [("s", ids, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=4))])
    check(firsts["s"], reference(load_hf(path), ids, 4), 4)


def test_bounds_are_checked(hf_checkpoints):
    core = EngineCore(EngineConfig(model=str(hf_checkpoints["qwen3_5"]), page_size=4))
    for bad in (-1, 21, True, 2.5):
        with pytest.raises(RequestError, match="prompt_logprobs"):
            core.make_request([1, 2, 3], SamplingParams(prompt_logprobs=bad))

"""Speculative decoding with the MTP module across the mesh's real processes: prefill workers draft the first
tokens after the one they sample, the drafts travel with the lease (the MTP's KV for the prompt in the KV pages),
and decode workers verify them in their first step; greedy output equals the monolithic engine's without MTP."""

import asyncio

import pytest
from harness import start_mesh
from test_mesh import generate_all, random_prompts, spread

from deltamesh.engine import DEFAULT_MODEL, SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.spec]


MODEL = str(DEFAULT_MODEL)  # with the MTP module scripts/make_default_mtp.py trained: drafts accepted and rejected


def check(mesh, reference_engine, n_prompts=8, seed=0, max_tokens=24):
    vocab = reference_engine.core.model_config.vocab_size
    prompts = random_prompts(n_prompts, vocab, spread(n_prompts, 1, 120), seed)
    results = asyncio.run(generate_all(mesh.router_address, prompts, max_tokens=max_tokens, temperature=0))
    ref = reference_engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    for r, e in zip(results, ref):
        assert (r.token_ids, r.text, r.finish_reason) == (e.token_ids, e.text, e.finish_reason.value)
    assert mesh.wait_idle() == {}


@pytest.mark.parametrize("k", [1, 3])
def test_one_prefill_one_decode_worker_with_mtp_match_the_engine_without(tmp_path, reference_engine, k):
    m = start_mesh(MODEL, tmp_path, worker_args=["--speculative-tokens", str(k)])
    try:
        check(m, reference_engine, seed=k)
    finally:
        m.stop()


def test_vllm_speculative_config_and_a_prefix_cache_second_turn(tmp_path, reference_engine):
    """vLLM's --speculative-config form, colocated with the prefix cache: a conversation's second turn (its prompt
    repeats the first turn's prompt and reply) starts from the first turn's state and still gives the monolithic
    engine's tokens."""
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    m = start_mesh(MODEL, tmp_path, prefill=0, decode=0, colocated=1, worker_args=["--speculative-config", spec])
    try:
        vocab = reference_engine.core.model_config.vocab_size
        first = random_prompts(1, vocab, [70], seed=5)[0]
        params = SamplingParams(max_tokens=16, temperature=0)
        [reply] = asyncio.run(generate_all(m.router_address, [first], max_tokens=16, temperature=0))
        assert reply.token_ids == reference_engine.generate([first], params)[0].token_ids
        second = first + reply.token_ids + random_prompts(1, vocab, [9], seed=6)[0]
        [again] = asyncio.run(generate_all(m.router_address, [second], max_tokens=16, temperature=0))
        assert again.token_ids == reference_engine.generate([second], params)[0].token_ids
        hits = m.workers("colocated")[0].load().prefix_cache_hit_tokens
        assert hits >= len(first) + len(reply.token_ids) - 1  # the first turn's whole state, reply included
        assert m.wait_idle() == {}
    finally:
        m.stop()

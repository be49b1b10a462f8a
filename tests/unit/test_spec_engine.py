"""Speculative decoding with the MTP module (engine/spec/), in one engine: greedy output with K drafts per step
equals greedy output without them, token for token, on every family, with async scheduling on and off. The
checkpoints' MTP modules are random, so nearly every draft is rejected (the reject path); a test-only draft source
that proposes the reference continuation makes every draft accepted, and one with a wrong token at a chosen
position makes verification reject there, so the GDN state and the KV roll back to an accepted prefix mid-run."""

import pytest
import torch
from hf_checkpoints import VOCAB
from idle_pools import assert_idle
from spec_drafts import ReferenceDrafter, prefill_then_decode

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore

pytestmark = pytest.mark.spec
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def prompts(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def engine(path, k, **kw):
    settings = dict(model=str(path), page_size=4, max_num_seqs=8, max_num_batched_tokens=64, speculative_tokens=k)
    return EngineCore(EngineConfig(**(settings | kw)))


def run(core, ps, params=GREEDY, ids=None):
    """Every prompt to the end, submitted at once; {request id: tokens}."""
    results, finals = {}, {}

    def sink(out):
        results.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out

    ids = ids or [f"r{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        core.submit(core.make_request(p, params, rid), sink)
    while len(finals) < len(ps):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    assert not [out.error for out in finals.values() if out.error]
    return {rid: results[rid] for rid in ids}


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """{family: greedy outputs of `prompts(4)` without speculative decoding}."""
    return {f: run(engine(hf_checkpoints[f], 0), prompts(4)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_with_mtp_drafts_equals_greedy_output_without(hf_checkpoints, references, family, k):
    core = engine(hf_checkpoints[family], k)
    assert run(core, prompts(4)) == references[family]
    assert core.stats.spec_drafts > 0
    assert_idle(core)


def test_greedy_output_is_the_same_without_async_scheduling(hf_checkpoints, references):
    core = engine(hf_checkpoints["qwen3_5_moe"], 2, async_scheduling=False)
    assert run(core, prompts(4)) == references["qwen3_5_moe"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_drafts_of_the_reference_continuation_are_all_accepted(hf_checkpoints, references, family, async_scheduling):
    ps, k = prompts(4), 3
    core = engine(hf_checkpoints[family], k, async_scheduling=async_scheduling)
    refs = {rid: p + out for (rid, out), p in zip(references[family].items(), ps)}
    core.runner.spec.drafter = ReferenceDrafter(refs, VOCAB)
    assert run(core, ps) == references[family]
    stats = core.stats
    # every draft is accepted but those past a request's 20th token: its last verify step, cut by max_tokens, emits
    # fewer than K (each one counted, though that step commits one input fewer than it emits)
    assert 0 <= stats.spec_drafts - stats.spec_accepted <= (k - 1) * len(ps) and stats.spec_drafts > 0
    assert stats.spec_accepted_at[0] >= stats.spec_accepted_at[1] >= stats.spec_accepted_at[2] > 0
    steps = stats.steps
    assert steps <= 2 + 20 // (k + 1) * 2  # about (K+1) tokens per step, not one
    assert_idle(core)


@pytest.mark.parametrize("wrong_at", [1, 6, 7])
def test_a_wrong_draft_is_rejected_and_the_state_rolls_back_to_the_accepted_prefix(
    hf_checkpoints, references, wrong_at
):
    """The draft at output index `wrong_at` is wrong: verification keeps the drafts before it and the target's own
    token in its place; the GDN state and KV of the rejected drafts are dropped (or every later token would
    differ)."""
    family, ps = "qwen3_next", prompts(4)
    core = engine(hf_checkpoints[family], 3)
    refs = {rid: p + out for (rid, out), p in zip(references[family].items(), ps)}
    core.runner.spec.drafter = ReferenceDrafter(refs, VOCAB, wrong_at=wrong_at)
    assert run(core, ps) == references[family]
    assert 0 < core.stats.spec_accepted < core.stats.spec_drafts
    assert_idle(core)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(hf_checkpoints, references):
    family, ps = "qwen3_5", prompts(4)
    ref = references[family]
    stop = ref["r1"][9]  # the 10th token of r1 (an accepted draft)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    plain = run(engine(hf_checkpoints[family], 0), ps, params)
    core = engine(hf_checkpoints[family], 3)
    core.runner.spec.drafter = ReferenceDrafter({rid: p + out for (rid, out), p in zip(ref.items(), ps)}, VOCAB)
    got = run(core, ps, params)
    assert got == plain and got["r1"][-1] == stop and len(got["r1"]) <= 10
    assert_idle(core)


def test_steps_replayed_through_the_verify_graphs_parts_give_the_same_tokens(hf_checkpoints, references):
    """spec/graphs.py's two parts on their static buffers, run as plain calls (capture=False: no GPU here): the
    verify-only steps take them, padding rows and all, and the tokens are unchanged."""
    from deltamesh.engine.spec.graphs import VerifyGraphs

    core = engine(hf_checkpoints["qwen3_5_moe"], 2)
    spec = core.runner.spec
    spec.graphs = VerifyGraphs(
        spec, 8, core.kv_pool.pages_for(core.max_model_len + 6), buckets=(1, 2, 8), capture=False
    )
    assert run(core, prompts(4)) == references["qwen3_5_moe"]
    assert core.runner.graph_steps > 5
    assert_idle(core)


def test_a_held_prefill_state_with_its_drafts_resumes_on_a_decode_engine(hf_checkpoints, references):
    """P/D without a transport: the prefill engine holds the prompt's state (its pages the prompt's only: the room
    its drafts took is given back) and its first token's drafts; their bytes, region for region, and the drafts
    start the decode engine, which verifies them in its first step."""
    path, ps = hf_checkpoints["qwen3_5"], [p[:n] for p, n in zip(prompts(4), (3, 7, 15, 30))]
    want = run(engine(path, 0), ps)
    prefill, decode = engine(path, 3), engine(path, 3)
    refs = {f"r{i}": p + want[f"r{i}"] for i, p in enumerate(ps)}
    prefill.runner.spec.drafter = decode.runner.spec.drafter = ReferenceDrafter(refs, VOCAB)

    def check(rid, drafts, held, reserved):
        assert drafts == want[rid][1:4]  # the reference continuation's next three tokens
        assert [r.nbytes for r in reserved] == [r.nbytes for r in held]

    requests = [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    results = prefill_then_decode(prefill, decode, requests, check)
    assert results == want and decode.stats.spec_accepted > 0.7 * decode.stats.spec_drafts
    assert_idle(prefill)
    assert_idle(decode)


def test_a_speculative_engine_takes_every_sampling_field(hf_checkpoints):
    """Penalties, logit_bias and min_tokens run over every verified position (test_spec_penalties.py), grammars mask
    it (test_spec_structured.py, on the default model: a grammar needs a tokenizer, which these checkpoints lack):
    a speculative engine refuses none of them."""
    spec = engine(hf_checkpoints["qwen3_5"], 2)
    for params in [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(logit_bias={3: 1.0}),
        SamplingParams(min_tokens=2),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=1),
    ]:
        spec.make_request([1, 2, 3], params)


def test_a_prompt_longer_than_a_step_is_chunked_through_steps_in_which_nothing_samples(hf_checkpoints):
    """Steps of prompt chunks only: the acceptance has no request to accept for (it used to fail on them)."""
    path, ps = hf_checkpoints["qwen3_5"], [list(range(1, 50)), prompts(1)[0]]
    want = run(engine(path, 0, max_num_batched_tokens=16), ps)
    core = engine(path, 2, max_num_batched_tokens=16)
    assert run(core, ps) == want
    assert_idle(core)

"""Speculative decoding on a tensor-parallel engine (CPU, gloo, one process per rank): every rank verifies its
heads' part, the leader accepts and sends the counts, every rank commits its part of the GDN states and runs its
part of the MTP module; greedy tokens and logprobs equal the one-rank engine's without MTP."""

import pytest
from hf_checkpoints import VOCAB
from test_tensor_parallel import assert_same, engine, prompts, run

from deltamesh.engine import FinishReason, SamplingParams

pytestmark = [pytest.mark.parallel, pytest.mark.spec]


@pytest.mark.parametrize(
    ("family", "k", "expert_parallel"), [("qwen3_5", 2, False), ("qwen3_5_moe", 3, True), ("qwen3_next", 1, False)]
)
def test_two_ranks_with_mtp_match_one_rank_without(hf_checkpoints, family, k, expert_parallel):
    path = hf_checkpoints[family]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    with engine(path, 2, speculative_tokens=k, enable_expert_parallel=expert_parallel) as e:
        got = e.generate(prompts(), params)
        assert e.core.stats.spec_drafts > 0
    # tokens exactly; logprobs within 5e-4: a verify step's logits come from matmuls over K+1 rows per request,
    # whose fp32 rounding differs from one-row decode steps (up to 1.8e-4 on the Qwen3-Next checkpoint; the same
    # with one rank, so not the split)
    assert_same(got, run(path, 1), tol=5e-4)


def test_two_ranks_with_mtp_and_penalties_match_one_rank_without(hf_checkpoints):
    """The leader runs the logits stage over every verified position and counts what it accepts; the followers
    take its counts. Logprobs are of the logits before the stage (a copy is adjusted)."""
    path = hf_checkpoints["qwen3_5"]
    params = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        logprobs=3,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias={5: 6.0},
    )
    with engine(path, 2, speculative_tokens=2) as e:
        got = e.generate(prompts(), params)
        assert e.core.stats.spec_drafts > 0
    with engine(path, 1) as e:
        want = e.generate(prompts(), params)
    assert_same(got, want, tol=5e-4)


@pytest.mark.parametrize(("family", "draft_vocab"), [("qwen3_5_moe", "spread"), ("qwen3_5", "100")])
def test_two_ranks_with_a_reduced_draft_vocabulary_match_one_rank_without_mtp(
    hf_checkpoints, tmp_path, family, draft_vocab
):
    """Each rank keeps the hot rows of its own vocabulary shard (ids [0, 160) and [160, 320) here) and the best of
    the ranks' proposals is the draft: the drafts are one rank's with the same hot set, step for step, and the
    greedy tokens the one-rank engine's without MTP. "spread": hot ids on both ranks, drafts come from both;
    "100": the 100 lowest ids, all on rank 0 (rank 1 proposes nothing)."""
    import torch
    from test_spec_draft_vocab import recording

    path = hf_checkpoints[family]
    hot = set(range(1, VOCAB, 3)) if draft_vocab == "spread" else set(range(100))
    setting = draft_vocab
    if draft_vocab == "spread":
        setting = str(tmp_path / "hot.pt")
        torch.save(torch.tensor(sorted(hot)), setting)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    with engine(path, 2, speculative_tokens=3, speculative_draft_vocab=setting) as e:
        drafter = recording(e.core)
        got = e.generate(prompts(), params)
        assert e.core.stats.spec_drafts > 0
    with engine(path, 1, speculative_tokens=3, speculative_draft_vocab=setting) as e:
        one_rank = recording(e.core)
        assert_same(e.generate(prompts(), params), got, tol=5e-4)
    # the same steps propose the same drafts as one rank's argmax over the whole hot set
    assert drafter.proposed == one_rank.proposed and set(drafter.proposed) <= hot
    if draft_vocab == "spread":  # the gathered proposals' winners come from either rank's shard
        assert min(drafter.proposed) < VOCAB // 2 <= max(drafter.proposed)
    assert_same(got, run(path, 1), tol=5e-4)


def test_two_ranks_with_mtp_and_grammars_match_one_rank_without():
    """Structured outputs (JSON schema, regex, choice, JSON object, EBNF, a schema with a penalty, and a request
    without a grammar in the same steps) on two ranks with K = 2: the leader masks every verified position with
    the grammars' matchers and advances them through what it accepts, the followers take its counts; greedy tokens
    equal the one-rank engine's without MTP. The default model: its tokenizer and its trained MTP module (drafts
    accepted and rejected)."""
    from test_spec_penalties import run as run_core
    from test_spec_structured import PARAMS, PROMPTS
    from test_spec_structured import engine as core_engine

    want, _ = run_core(core_engine(0), PROMPTS, PARAMS)
    core = core_engine(2, tensor_parallel_size=2, torch_threads=1)
    try:
        got, finals = run_core(core, PROMPTS, PARAMS)
        assert core.stats.spec_drafts > 0 and 0 < core.stats.spec_accepted < core.stats.spec_drafts
    finally:
        core.close()
    assert got == want
    assert finals["r2"].finish_reason == FinishReason.STOP  # the choice's grammar ended it (ignore_eos is set)

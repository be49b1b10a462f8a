"""The plumbing of piecewise CUDA graphs (cuda_graphs.PiecewiseGraphs), its pieces run as plain calls on the CPU:
steps with prompt tokens, through the pieces' static buffers and padded to their bucket, give the eager forward's
tokens and log-probabilities (fp32, each family). The steps mix decodes with prefill chunks, and one chunk takes
a prefix-cache checkpoint in passing. The captured graphs themselves: tests/gpu/test_gpu_async.py."""

import pytest
import torch
from hf_checkpoints import VOCAB

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs, piecewise_buckets

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
BUDGET = 24  # buckets 16 and 24: most steps are padded
PARAMS = [
    SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=5, temperature=0.9, seed=3, ignore_eos=True, logprobs=2),
]


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model_dir, pieces: bool):
    core = EngineCore(
        EngineConfig(model=str(model_dir), page_size=4, max_num_batched_tokens=BUDGET, max_num_seqs=4, num_kv_pages=96)
    )
    if pieces:
        core.runner.pieces = PiecewiseGraphs(core.runner, BUDGET, capture=False)
    out = {}

    def sink(o):
        tokens, logprobs = out.setdefault(o.request_id, ([], []))
        tokens.extend(o.new_token_ids)
        logprobs.extend(lp.logprob for lp in o.logprobs or [])

    # 30 tokens: chunks of 24 and 6, the second past the checkpoint at 28 (taken in passing); the others arrive
    # while it decodes, so later steps mix decodes with prefill
    for i, (n, seed) in enumerate([(30, 1), (5, 2), (11, 3), (19, 4)]):
        core.submit(core.make_request(prompt(n, seed), PARAMS[i % 2], f"r{i}"), sink)
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    while core.has_work:
        core.dispatch(core.step())
    return out, core


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_give_the_eager_forwards_tokens(family, hf_checkpoints):
    eager, _ = run(hf_checkpoints[family], pieces=False)
    piecewise, core = run(hf_checkpoints[family], pieces=True)
    # the same tokens; log-probabilities to 1e-4 (padded rows change the reduction order of the MoE's sums on
    # some CPUs, so a rounding to four places can land either side of a boundary)
    assert {r: tokens for r, (tokens, _) in piecewise.items()} == {r: tokens for r, (tokens, _) in eager.items()}
    for r, (_, logprobs) in eager.items():
        assert piecewise[r][1] == pytest.approx(logprobs, abs=1e-4)
    assert all(len(tokens) == 5 for tokens, _ in eager.values())
    # every step ran through the pieces (no decode graphs on the CPU), four or more of them with prompt tokens
    assert core.runner.piecewise_steps == core.stats.steps and core.stats.mixed_steps >= 4
    assert core.stats.checkpoints_saved >= 1


def test_buckets():
    assert piecewise_buckets(4096) == [
        16,
        32,
        64,
        128,
        256,
        512,
        768,
        1024,
        1280,
        1536,
        1792,
        2048,
        2560,
        3072,
        3584,
        4096,
    ]
    assert piecewise_buckets(100) == [16, 32, 64, 100] and piecewise_buckets(8) == [8]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_graphs_batch_runs_through_the_forward(family, hf_checkpoints):
    """What DecodeGraphs.capture runs (a decode-only batch with no prefill offsets, padding rows on the scratch page
    and slot), here uncaptured on the CPU: each family's forward takes it."""
    core = EngineCore(EngineConfig(model=str(hf_checkpoints[family]), page_size=4, max_num_seqs=4, num_kv_pages=96))
    r = core.runner
    graphs = DecodeGraphs(r, 4, max_pages=8)
    for b in graphs.buckets:
        hidden = r.model(graphs.input_ids[:b], graphs._batch(b), r.kv_pool, r.state_pool, r.kernels)
        assert r.model.logits(hidden).shape == (b, VOCAB)

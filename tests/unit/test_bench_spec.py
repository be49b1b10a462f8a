"""bench/gpu_spec.py's parts that need no GPU: its verify steps run through a CPU engine as the benchmark runs
them, and its projection arithmetic."""

import pytest

from bench.gpu_common import timeline_gaps
from bench.gpu_spec import PUBLISHED_ACCEPTANCE, disable_batches, floor_ms, projections, verify_items
from deltamesh.engine import EngineConfig
from deltamesh.engine.core import EngineCore
from deltamesh.engine.spec import tokens as spec_tokens
from deltamesh.engine.spec.runner import SpecSampling

pytestmark = pytest.mark.spec


def spec_core(path, draft_vocab=None) -> EngineCore:
    settings = dict(model=str(path), page_size=8, max_num_seqs=4, speculative_tokens=2)
    return EngineCore(EngineConfig(**settings, speculative_draft_vocab=draft_vocab))


@pytest.mark.parametrize("draft_vocab", [None, "64"])
def test_the_benchmarks_verify_step_runs_as_the_engine_runs_it(hf_checkpoints, draft_vocab):
    core = spec_core(hf_checkpoints["qwen3_5"], draft_vocab)
    items = verify_items(core, 3, 40, 2)
    reqs = [it.request for it in items]
    sampling = SpecSampling(spec_tokens.accept_inputs(reqs, core.max_model_len), core.launcher.generator, reqs)
    out = core.runner.execute(items, None, None, sampling)
    assert out.next_tokens.shape == (3,) and out.drafts.shape == (3, 2)
    assert ((out.accepted.counts >= 1) & (out.accepted.counts <= 3)).all()
    if draft_vocab:  # --draft-vocab N drafts over the N lowest ids
        assert int(out.drafts.max()) < int(draft_vocab)


def test_the_floor_reads_the_reduced_draft_heads_rows_per_draft_not_the_whole_lm_head(hf_checkpoints):
    """K = 2 drafts each read 64 rows of the LM head instead of all 320: the floor drops by 2 x 256 rows' bytes."""
    path, bandwidth = hf_checkpoints["qwen3_5_moe"], 1e9
    whole, reduced = spec_core(path), spec_core(path, "64")
    head = whole.model.lm_head
    row_bytes = head.shape[1] * head.element_size()
    saved = floor_ms(whole, 2, 3, 40, bandwidth) - floor_ms(reduced, 2, 3, 40, bandwidth)
    assert saved == pytest.approx(2 * (head.shape[0] - 64) * row_bytes / bandwidth * 1e3)


def test_the_projection_divides_a_step_by_the_tokens_it_yields():
    rows = [
        {
            "model": "m",
            "k": 0,
            "draft_vocab": 0,
            "batch": 1,
            "wall_ms": 3.0,
            "gpu_ms": 2.9,
            "pipelined_ms": 2.5,
            "floor_ms": 1.5,
        },
        {
            "model": "m",
            "k": 3,
            "draft_vocab": 0,
            "batch": 1,
            "wall_ms": 4.0,
            "gpu_ms": 3.9,
            "pipelined_ms": 3.2,
            "floor_ms": 2.0,
        },
        {
            "model": "m",
            "k": 0,
            "draft_vocab": 0,
            "batch": 64,
            "wall_ms": 6.0,
            "gpu_ms": 6.0,
            "pipelined_ms": 6.0,
            "floor_ms": 4.0,
        },
        {
            "model": "m",
            "k": 3,
            "draft_vocab": 0,
            "batch": 64,
            "wall_ms": 19.0,
            "gpu_ms": 19.0,
            "pipelined_ms": 19.0,
            "floor_ms": 9.0,
        },
        {
            "model": "m",
            "k": 3,
            "draft_vocab": 32,
            "batch": 1,
            "wall_ms": 3.5,
            "gpu_ms": 3.4,
            "pipelined_ms": 3.0,
            "floor_ms": 1.8,
        },
    ]
    projected = projections(rows, list(PUBLISHED_ACCEPTANCE))
    one, many, reduced = projected
    assert one["tokens_per_step"] == pytest.approx(2.93)  # the published mean accepted length at K = 3
    assert one["tpot_ms"] == pytest.approx(4.0 / 2.93) and one["speedup"] == pytest.approx(3.0 / (4.0 / 2.93))
    assert one["floor_tpot_ms"] == pytest.approx(2.0 / 2.93)  # the verify step's roofline over the same tokens
    # steps back to back (the host's preparation hidden), against the plain step measured the same way
    assert one["pipelined_tpot_ms"] == pytest.approx(3.2 / 2.93)
    assert one["pipelined_speedup"] == pytest.approx(2.5 / (3.2 / 2.93))
    assert many["speedup"] < 1
    # a reduced draft vocabulary's rows against the same plain step, at the same acceptance
    assert (reduced["draft_vocab"], reduced["speedup"]) == (32, pytest.approx(3.0 / (3.5 / 2.93)))
    assert disable_batches(projected) == [
        {"model": "m", "k": 3, "draft_vocab": 0, "disable_batch": 64},
        {"model": "m", "k": 3, "draft_vocab": 32, "disable_batch": None},
    ]


def test_the_timeline_counts_idle_time_between_kernels_once_and_names_the_kernel_before_it():
    """Two steps back to back (us): overlapping kernels count their union as busy; each gap goes to the kernel
    that ran before it, averaged per step."""
    kernels = [
        ("gemm", 0.0, 100.0),
        ("norm", 50.0, 100.0),  # overlaps gemm: busy 0-150
        ("accept", 200.0, 10.0),  # 50 us idle after norm
        ("gemm", 1210.0, 100.0),  # 1000 us idle after accept (the next step)
        ("norm", 1310.0, 40.0),  # back to back: no gap
        ("accept", 1400.0, 10.0),  # 50 us idle after norm
    ]
    t = timeline_gaps(kernels, steps=2)
    assert t["span_ms"] == pytest.approx(1410 / 2 / 1e3)
    assert t["busy_ms"] == pytest.approx((150 + 10 + 100 + 40 + 10) / 2 / 1e3)
    assert t["idle_ms"] == pytest.approx((50 + 1000 + 50) / 2 / 1e3)
    assert t["kernels"] == 3
    first, second = t["after"]
    assert (first["kernel"], first["gaps"], first["ms"], first["largest_us"]) == ("accept", 0.5, 0.5, 1000.0)
    assert (second["kernel"], second["gaps"], second["ms"], second["largest_us"]) == ("norm", 1.0, 0.05, 50.0)
    # every kernel twice in two steps: once a step each, gemm the longest
    assert [(r["kernel"], r["launches"]) for r in t["frequent"]] == [("gemm", 1.0), ("norm", 1.0), ("accept", 1.0)]
    assert t["frequent"][1]["us"] == pytest.approx(70.0) and t["frequent"][1]["us_each"] == pytest.approx(70.0)
    assert timeline_gaps([], steps=1)["idle_ms"] == 0.0
    # a gap goes to the kernel that ended last, not to the one that started last
    t = timeline_gaps([("a", 0.0, 200.0), ("b", 50.0, 50.0), ("c", 300.0, 10.0)], steps=1)
    assert [(r["kernel"], r["largest_us"]) for r in t["after"]] == [("a", 100.0)]

"""bench/gpu_spec.py's parts that need no GPU: its verify steps run through a CPU engine as the benchmark runs
them, and its projection arithmetic."""

import pytest

from bench.gpu_spec import PUBLISHED_ACCEPTANCE, disable_batches, projections, verify_items
from deltamesh.engine import EngineConfig
from deltamesh.engine.core import EngineCore
from deltamesh.engine.spec import tokens as spec_tokens
from deltamesh.engine.spec.runner import SpecSampling

pytestmark = pytest.mark.spec


def test_the_benchmarks_verify_step_runs_as_the_engine_runs_it(hf_checkpoints):
    core = EngineCore(
        EngineConfig(model=str(hf_checkpoints["qwen3_5"]), page_size=8, max_num_seqs=4, speculative_tokens=2)
    )
    items = verify_items(core, 3, 40, 2)
    reqs = [it.request for it in items]
    sampling = SpecSampling(spec_tokens.accept_inputs(reqs, core.max_model_len), core.launcher.generator, reqs)
    out = core.runner.execute(items, None, None, sampling)
    assert out.next_tokens.shape == (3,) and out.drafts.shape == (3, 2)
    assert ((out.accepted.counts >= 1) & (out.accepted.counts <= 3)).all()


def test_the_projection_divides_a_step_by_the_tokens_it_yields():
    rows = [
        {"model": "m", "k": 0, "batch": 1, "wall_ms": 3.0, "gpu_ms": 2.9},
        {"model": "m", "k": 3, "batch": 1, "wall_ms": 4.0, "gpu_ms": 3.9},
        {"model": "m", "k": 0, "batch": 64, "wall_ms": 6.0, "gpu_ms": 6.0},
        {"model": "m", "k": 3, "batch": 64, "wall_ms": 19.0, "gpu_ms": 19.0},
    ]
    projected = projections(rows, list(PUBLISHED_ACCEPTANCE))
    one, many = projected
    assert one["tokens_per_step"] == pytest.approx(2.93)  # the published mean accepted length at K = 3
    assert one["tpot_ms"] == pytest.approx(4.0 / 2.93) and one["speedup"] == pytest.approx(3.0 / (4.0 / 2.93))
    assert many["speedup"] < 1
    assert disable_batches(projected) == [{"model": "m", "k": 3, "disable_batch": 64}]

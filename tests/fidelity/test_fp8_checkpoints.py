"""FP8 block-scaled checkpoints (Qwen's published format), written by scripts/write_fp8_checkpoint.py from the
tiny random transformers checkpoints: the engine, dequantizing while it loads, must give exactly what
transformers gives for the same FP8 checkpoint (transformers dequantizes it on CPU), fp32, three families."""

import pytest
import torch
from fidelity.test_transformers_fidelity import (  # noqa: F401  (family: the fixture)
    FAMILIES,
    assert_greedy_generation_matches,
    engine_logits,
    family,
    hf_logits,
    prompt,
)
from hf_checkpoints import load_hf

from deltamesh.engine import EngineConfig
from deltamesh.engine.core import EngineCore
from scripts.write_fp8_checkpoint import write_fp8_checkpoint

pytestmark = pytest.mark.fidelity
BLOCK = (8, 8)  # every quantized dim of the tiny models is a multiple of 8: a grid of many blocks per weight


@pytest.fixture(scope="module")
def fp8_checkpoints(hf_checkpoints, tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    return {fam: write_fp8_checkpoint(hf_checkpoints[fam], base / fam, BLOCK) for fam in FAMILIES}


@pytest.fixture(scope="module")
def hf_fp8(fp8_checkpoints, family):
    return load_hf(fp8_checkpoints[family])


def test_the_checkpoint_really_is_fp8(fp8_checkpoints, hf_checkpoints, family):
    from safetensors import safe_open

    with safe_open(str(fp8_checkpoints[family] / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_tensor(n).dtype for n in f.keys() if n.endswith("o_proj.weight")}
        scales = [n for n in f.keys() if n.endswith("weight_scale_inv")]
    assert dtypes == {torch.float8_e4m3fn} and len(scales) > 10
    core = EngineCore(EngineConfig(model=str(fp8_checkpoints[family]), page_size=8, max_num_seqs=2))
    orig = EngineCore(EngineConfig(model=str(hf_checkpoints[family]), page_size=8, max_num_seqs=2))
    ids = prompt(20)
    assert (engine_logits(core, ids, [20]) - engine_logits(orig, ids, [20])).abs().max() > 1e-2  # not the bf16 model


def test_logits_equal_transformers_on_the_same_fp8_checkpoint(fp8_checkpoints, family, hf_fp8):
    core = EngineCore(
        EngineConfig(model=str(fp8_checkpoints[family]), page_size=8, max_num_seqs=4, max_num_batched_tokens=64)
    )
    ids = prompt(60, seed=5)
    got = engine_logits(core, ids, [40] + [1] * 20)
    assert (got - hf_logits(hf_fp8, ids)).abs().max() <= 1e-4


def test_greedy_generation_equals_transformers(fp8_checkpoints, family, hf_fp8):
    assert_greedy_generation_matches(fp8_checkpoints[family], hf_fp8, prompt(33, seed=6), 24)

"""FP8 weights kept as FP8 (`--quantization`): the projections hold an FP8 checkpoint's e4m3 values and block
scales exactly as written, a bf16 checkpoint's are quantized on load into the same format, and the torch reference (which dequantizes them) gives exactly the dequantized
model's output. The GPU kernels' arithmetic is checked in
tests/gpu/test_gpu_fp8.py."""

import pytest
import torch
from fidelity.test_transformers_fidelity import engine_logits, prompt
from hf_checkpoints import write_checkpoint
from safetensors import safe_open

from deltamesh.engine import Engine, EngineConfig
from deltamesh.engine.core import EngineCore
from deltamesh.engine.sampling import SamplingParams
from deltamesh.engine.weights import WeightError
from deltamesh.kernels.fp8 import Fp8Weight, dequantize
from scripts.write_fp8_checkpoint import write_fp8_checkpoint


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return write_checkpoint("qwen3_5_moe_fp8_shapes", tmp_path_factory.mktemp("aligned"), seed=3)


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory):
    return write_fp8_checkpoint(bf16_dir, tmp_path_factory.mktemp("aligned_fp8"))


def core(model_dir, quantization, **kw):
    return EngineCore(EngineConfig(model=str(model_dir), page_size=8, max_num_seqs=2, quantization=quantization, **kw))


def test_the_checkpoints_values_and_scales_are_kept_as_written(fp8_dir):
    model = core(fp8_dir, "fp8").model
    gdn, moe = model.layers[0].mixer, model.layers[0].mlp
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        get = lambda name: f.get_tensor(f"model.layers.0.{name}")  # noqa: E731
        up, i = get("mlp.experts.2.up_proj.weight"), moe.inter
        assert torch.equal(moe.w13[2, i:].view(torch.uint8), up.view(torch.uint8))
        assert torch.equal(moe.w13_scale[2, i // 128 :], get("mlp.experts.2.up_proj.weight_scale_inv"))
        down = get("mlp.shared_expert.down_proj.weight")
        assert torch.equal(moe.shared.down.view(torch.uint8), down.view(torch.uint8))
        assert torch.equal(
            gdn.in_proj[: gdn.conv_dim].view(torch.uint8), get("linear_attn.in_proj_qkv.weight").view(torch.uint8)
        )
        assert torch.equal(gdn.in_proj_scale[gdn.conv_dim // 128 :], get("linear_attn.in_proj_z.weight_scale_inv"))
        assert torch.equal(gdn.in_proj_ba[: gdn.hv], get("linear_attn.in_proj_b.weight"))  # the gates stay float
    assert model.lm_head.dtype == torch.float32


def test_fp8_weights_compute_what_the_dequantized_model_computes(fp8_dir):
    kept, dequantized = core(fp8_dir, "fp8"), core(fp8_dir, "none")
    assert dequantized.model.layers[1].mixer.qkv.dtype == torch.float32
    ids = prompt(40, seed=2)
    # The same weights, the same arithmetic, up to float32 summation order: the kept model projects its GDN gates
    # apart (they stay float), the dequantized one fuses them into the FP8 projection's matmul, and MKL may sum a
    # wider matmul in another order (as it does on an AVX2 machine; wrong values or scales move logits by ~1).
    assert (engine_logits(kept, ids, [24, 16]) - engine_logits(dequantized, ids, [24, 16])).abs().max() <= 1e-4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for quantization in ("fp8", "none"):
        with Engine(EngineConfig(model=str(fp8_dir), page_size=8, quantization=quantization)) as eng:
            outs.append(eng.generate(ids, params)[0].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_a_bf16_checkpoint_is_quantized_on_load_as_the_fp8_writer_does(bf16_dir, fp8_dir):
    online = dict(core(bf16_dir, "fp8").model.named_parameters())
    written = dict(core(fp8_dir, "fp8").model.named_parameters())
    fp8 = [name for name, p in online.items() if p.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 2 * 4 + 2 + 2  # each layer's w13, w2 and shared expert; GDN in/out; attention qkv/o
    for name in fp8:
        assert torch.equal(online[name].view(torch.uint8), written[name].view(torch.uint8)), name
        assert torch.equal(online[name + "_scale"], written[name + "_scale"]), name


def test_dummy_fp8_weights_are_quantized_random_weights(bf16_dir):
    moe = core(bf16_dir, "fp8", load_format="dummy").model.layers[1].mlp
    w = dequantize(Fp8Weight(moe.w13, moe.w13_scale))
    assert moe.w13_scale.min() > 0 and 0.05 < w.std() * 128**0.5 < 20  # a spread like the bf16 dummy's


def test_qwen3_next_regrouped_projections_keep_the_checkpoints_fp8_values(tmp_path):
    """Qwen3-Next stores its GDN projections fused and grouped by key head; the engine's layout regroups them
    (dequantized, regrouped, quantized again: whole blocks move, so each gets its values and scale back, up to
    float32 rounding of the scale)."""
    fp8 = write_fp8_checkpoint(write_checkpoint("qwen3_next_fp8_shapes", tmp_path / "bf16", seed=5), tmp_path / "fp8")
    kept, dequantized = core(fp8, "fp8"), core(fp8, "none")
    assert kept.model.layers[0].mixer.in_proj.dtype == torch.float8_e4m3fn
    ids = prompt(40, seed=3)
    assert (engine_logits(kept, ids, [24, 16]) - engine_logits(dequantized, ids, [24, 16])).abs().max() <= 1e-4


def test_fp8_weights_are_refused_where_the_layout_cannot_hold_them(hf_checkpoints):
    with pytest.raises(WeightError, match="whole 128-row blocks, not hidden_size 64, head_dim 32"):
        core(hf_checkpoints["qwen3_5"], "fp8")
    with pytest.raises(WeightError, match="whole 128-row blocks"):
        core(hf_checkpoints["qwen3_next"], "fp8")
    with pytest.raises(ValueError, match="quantization must be auto, fp8 or none"):
        core(hf_checkpoints["qwen3_5"], "int4")


@pytest.mark.parallel
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_weights_split_over_two_ranks_give_the_one_rank_engines_output(fp8_dir, expert_parallel):
    """Each rank keeps its rows or columns of every FP8 weight with the matching block scales (whole experts
    under expert parallelism)."""
    from test_tensor_parallel import assert_same, engine, prompts, run

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    with engine(fp8_dir, 2, quantization="fp8", enable_expert_parallel=expert_parallel) as e:
        mixer, moe = e.core.model.layers[0].mixer, e.core.model.layers[0].mlp
        assert mixer.in_proj.dtype == moe.w13.dtype == torch.float8_e4m3fn
        assert moe.w13.shape[0] == (2 if expert_parallel else 4) and mixer.out_proj_scale.shape == (1, 2)
        got = e.generate(prompts(), params)
    assert_same(got, run(fp8_dir, 1, quantization="fp8"))

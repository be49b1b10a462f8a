"""Tiny random checkpoints written by transformers' own model classes (`save_pretrained`), for fidelity
tests: the engine loads them through its real loader and must reproduce transformers' outputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from scripts.mtp_head import MtpHead

VOCAB = 320

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
_MROPE = {**_ROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40)


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**_COMMON, intermediate_size=96, rope_parameters=_MROPE, tie_word_embeddings=True)
    return Qwen3_5ForCausalLM(cfg)


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**_COMMON, **_MOE, rope_parameters=_MROPE)
    return Qwen3_5MoeForCausalLM(cfg)


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # layers 0 and 2 dense (mlp_only_layers / sparse step), 1 and 3 MoE; norm_topk_prob off.
    cfg = Qwen3NextConfig(
        **_COMMON,
        **_MOE,
        intermediate_size=80,
        decoder_sparse_step=1,
        mlp_only_layers=[0, 2],
        norm_topk_prob=False,
        rope_parameters=_ROPE,
    )
    return Qwen3NextForCausalLM(cfg)


def _qwen3_5_moe_fp8_shapes():
    """Every projection in whole 128-row blocks, as the FP8 kernels need (real models are so; the others here
    are too small), also on each of two tensor-parallel ranks: one attention and one GDN layer."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    dims = dict(
        _COMMON,
        hidden_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    cfg = Qwen3_5MoeTextConfig(
        **dims,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        rope_parameters={**_MROPE, "mrope_section": [8, 4, 4]},
    )
    return Qwen3_5MoeForCausalLM(cfg)


def _qwen3_next_fp8_shapes():
    """Qwen3-Next with every projection in whole 128-row blocks (its fused, head-grouped GDN projections too):
    a dense layer with GDN, a MoE layer with attention."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    dims = dict(
        _COMMON,
        hidden_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    cfg = Qwen3NextConfig(
        **dims,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        rope_parameters=_ROPE,
    )
    return Qwen3NextForCausalLM(cfg)


BUILDERS = {"qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe, "qwen3_next": _qwen3_next}
FP8_SHAPES = {"qwen3_5_moe_fp8_shapes": _qwen3_5_moe_fp8_shapes, "qwen3_next_fp8_shapes": _qwen3_next_fp8_shapes}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers' init leaves logits nearly flat (greedy ties); give every weight a real spread."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.2 / p.shape[-1] ** 0.5))


def write_checkpoint(family: str, out: Path, seed: int = 0, mtp: bool = True) -> Path:
    """`family`: a key of BUILDERS or of FP8_SHAPES. `mtp`: with a random MTP module (`add_mtp`)."""
    torch.manual_seed(seed)
    model = (BUILDERS | FP8_SHAPES)[family]().eval()
    randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    if mtp:
        add_mtp(model, out, seed)
    return out


def add_mtp(model: nn.Module, out: Path, seed: int) -> None:
    """A random MTP module (scripts/mtp_head.py) beside a saved checkpoint: its tensors named `mtp.*` in a file of their
    own, as the released checkpoints ship them, and the config's count of MTP layers (Qwen3.5's
    `mtp_num_hidden_layers`, Qwen3-Next's `num_nextn_predict_layers`)."""
    torch.manual_seed(seed + 1000)
    mtp = MtpHead(model).eval()
    randomize(mtp, seed + 1000)
    save_file({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()}, str(out / "mtp.safetensors"))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    key = "num_nextn_predict_layers" if cfg.get("model_type") == "qwen3_next" else "mtp_num_hidden_layers"
    cfg[key] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))


def load_mtp_reference(model: nn.Module, path: Path) -> MtpHead:
    """The MTP module `add_mtp` wrote beside checkpoint `path`, for `model` (transformers' model of it)."""
    from safetensors.torch import load_file

    mtp = MtpHead(model)
    tensors = load_file(str(path / "mtp.safetensors"))
    mtp.load_state_dict({k.removeprefix("mtp."): v for k, v in tensors.items()})
    return mtp.to(next(model.parameters()).dtype).eval()


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_replicated_kv_checkpoint(out: Path, seed: int = 5) -> Path:
    """Qwen3.5 dense with one KV head for four query heads, so that two tensor-parallel ranks each hold a copy of
    it (replicated); 2 GDN key heads with 2 value heads each, so that q, k and v conv channels split unevenly."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        **{**_COMMON, "num_key_value_heads": 1}, intermediate_size=96, rope_parameters=_MROPE, tie_word_embeddings=True
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    return out

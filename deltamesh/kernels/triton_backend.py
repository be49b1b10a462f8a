"""The Triton backend (CUDA): paged decode attention (triton_attention) and the fused kernels
(triton_fused: norms, activations, attention inputs and output gate; triton_conv1d) that keep a
decode step's small ops to one kernel each, the fused MoE experts (triton_moe), linear layers with FP8
weights (triton_linear; cuBLAS for the others), at one token, projections that run the op before them as they
load their input (triton_fused_linear), and speculative verification's GDN steps (triton_verify)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltamesh.kernels.registry import Backend, ModelShapes, register_backend

FUSED_OPS = ("rms_norm", "add_rms_norm", "gated_rms_norm", "silu_mul")
CONV_OPS = ("conv1d_update", "conv1d_prefill")


def _load(device: torch.device, shapes: ModelShapes) -> tuple[dict[str, Callable], str]:
    if device.type != "cuda":
        return {}, "needs a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return {}, f"triton is not installed ({e})"
    if shapes.dtype == torch.float32:
        return {}, "fp32 models keep the exact torch reference (Triton dots would run in tf32)"
    from deltamesh.kernels import (
        triton_attention,
        triton_conv1d,
        triton_fused,
        triton_fused_linear,
        triton_linear,
        triton_moe,
        triton_verify,
    )

    ops = {op: getattr(triton_fused, op) for op in FUSED_OPS} | {op: getattr(triton_conv1d, op) for op in CONV_OPS}
    ops |= {"moe": triton_moe.moe, "linear": triton_linear.linear}
    ops |= {op: getattr(triton_fused_linear, op) for op in ("gated_norm_linear", "add_rms_norm_linear")}
    ops |= {"gdn_verify": triton_verify.gdn_verify, "conv1d_verify": triton_verify.conv1d_verify}
    if shapes.head_dim & (shapes.head_dim - 1) or shapes.page_size < 16:
        return ops, "the attention kernels need a power-of-two head dim and page size >= 16"
    attention = {op: getattr(triton_fused, op) for op in ("attention_inputs", "sigmoid_gate")}
    attention["gate_linear"] = triton_fused_linear.gate_linear
    return ops | attention | {"paged_attention": triton_attention.paged_attention}, ""


register_backend(Backend("triton", 15, _load))

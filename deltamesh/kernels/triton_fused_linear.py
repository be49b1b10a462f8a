"""Projections fused with the op before them (torch_ref.py has each op's meaning), for decode steps of few tokens:
the GEMV of triton_gemv.py computes the op as it loads its input (a `Prologue`), so the op is no kernel of its own.

- `gate_linear`: the attention's sigmoid output gate, then the output projection;
- `gated_norm_linear`: GDN's gated RMSNorm, then the output projection;
- `add_rms_norm_linear`: the residual add and the post-attention RMSNorm, then the MLP's or MoE layer's first
  projection (the router and shared-expert gate; the dense MLP's gate|up).

Each runs fused up to FUSED_MAX_TOKENS tokens (and a small weight, triton_gemv.small_weight_gemv, up to a few
tokens: the MoE router at a verify step's K+1 rows), where the weight is FP8 (it goes to the GEMV anyway at one
token) or has at most PLAIN_MAX_ROWS rows (cuBLAS reaches ~95 % of its floor on the wide bf16 projections, where the
GEMV is slower: bench/RESULTS.md, "Dense 9B projections at one token"). Past that, the op's own kernel
(triton_fused.py) and then the projection (triton_linear.py): what ran before the fusion, kernel for kernel.
"""

from __future__ import annotations

import torch

from deltamesh.kernels import triton_fused, triton_linear
from deltamesh.kernels.fp8 import Fp8Weight
from deltamesh.kernels.triton_gemv import (
    ADD_NORM,
    GATED_NORM,
    GEMV_TILE,
    SIGMOID_GATE,
    Prologue,
    gemv,
    small_weight_gemv,
)

# Read at each call (so when CUDA graphs are captured): 0 runs every op unfused (bench/gpu_fusion.py's A/B).
FUSED_MAX_TOKENS = 1
PLAIN_MAX_ROWS = 4096


def _fused(x: torch.Tensor, w) -> bool:
    plain_ok = not isinstance(w, Fp8Weight) and w.shape[0] <= PLAIN_MAX_ROWS and x.dtype == w.dtype
    tokens = x.shape[0]
    few = 0 < tokens <= FUSED_MAX_TOKENS or (FUSED_MAX_TOKENS > 0 and small_weight_gemv(tokens, w))
    return few and (isinstance(w, Fp8Weight) or plain_ok)


def _per_head(x: torch.Tensor) -> bool:
    """Whether the GEMV's loads of K take x's heads whole: a power-of-two head dim dividing its K step."""
    head = x.shape[-1]
    return x.dim() == 3 and head & (head - 1) == 0 and GEMV_TILE[1] % head == 0


def gate_linear(x: torch.Tensor, gate: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x * sigmoid(gate)) w^T (+ bias): x [T, H, D] contiguous, gate a [T, H, D] view (last dim contiguous)."""
    if not (_fused(x, w) and _per_head(x)):
        return triton_linear.linear(triton_fused.sigmoid_gate(x, gate), w, bias)
    return gemv(x, w, bias, prologue=Prologue(SIGMOID_GATE, gate))


def gated_norm_linear(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, w) -> torch.Tensor:
    """gated_rms_norm(x, z) w^T: x [T, H, D], z a [T, H, D] view (last dims contiguous)."""
    if not (_fused(x, w) and _per_head(x)):
        normed = triton_fused.gated_rms_norm(x, z, norm_weight, eps)
        return triton_linear.linear(normed.reshape(x.shape[0], -1), w)
    return gemv(x, w, prologue=Prologue(GATED_NORM, z, norm_weight, eps))


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, w):
    """(normed, x + residual, normed w^T), normed = rms_norm(x + residual): x, residual [T, K] of one dtype, rows
    contiguous."""
    if not _fused(x, w) or residual.dtype != x.dtype:
        normed, total = triton_fused.add_rms_norm(x, residual, norm_weight, eps)
        return normed, total, triton_linear.linear(normed, w)
    normed, total = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    out = gemv(x, w, prologue=Prologue(ADD_NORM, residual, norm_weight, eps, normed, total))
    return normed, total, out

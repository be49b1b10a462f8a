"""Linear layers with block-scaled FP8 weights (kernels/fp8.py says what they compute), and the FP8 helpers the
fused MoE kernels share.

- One token (T <= GEMV_MAX_TOKENS; any T for a layer cuBLAS cannot take): `_gemv`, one program per token and
  block of BLOCK_N output rows, reading the weight rows once per token; it quantizes the activations per group of 128 as it loads them
  and folds the weight's block scales into them, so the weight is read as e4m3 bytes and never dequantized in
  memory. Bound by the weight read: half of bf16's bytes.
- More tokens: the activations are quantized per token and group (`_quantize_groups`, one kernel) and cuBLAS's
  block-scaled FP8 GEMM (torch.nn.functional.scaled_mm: 1x128 activation blocks, 128x128 weight blocks) runs on
  the e4m3 tensor cores. cuBLAS takes 16-aligned token counts (the activations are padded with zero rows) and
  whole sets of 4 scale groups (K a multiple of 512); a layer that has not those runs the GEMV at any size.
Neither synchronises with the host, so CUDA graphs capture them. Plain (bf16) weights go to cuBLAS."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.functional import ScalingType
import triton
import triton.language as tl

from deltamesh.kernels.fp8 import BLOCK, Fp8Weight, reference_linear

# Up to this many tokens `_gemv` runs: its programs read the weight once per token, so past one token cuBLAS's
# GEMM wins (bench/RESULTS.md, "FP8 weights").
GEMV_MAX_TOKENS = 1


@triton.jit
def quantized_rows(a):
    """(e4m3 values, per-row scales) of an activation tile [rows, GROUP] in float32 (kernels/fp8.py)."""
    scale = tl.maximum(tl.max(tl.abs(a), 1), 1e-10) / 448.0  # fp8.E4M3_MAX
    return (a / scale[:, None]).to(tl.float8e4nv), scale


@triton.jit
def quantized_vector(a, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """An activation vector [BLOCK_K] in float32 as its e4m3 values times their group's scale (kernels/fp8.py)."""
    q, scale = quantized_rows(tl.reshape(a, (BLOCK_K // GROUP, GROUP)))
    return tl.reshape(q.to(tl.float32) * scale[:, None], (BLOCK_K,))


@triton.jit
def _gemv(x, w, w_scale, bias, out, N, K, stride_xm, stride_wn, stride_sn, stride_om, FP8: tl.constexpr,
          HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    t = tl.program_id(1)
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(x + t * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:  # BLOCK_N divides GROUP: the program's rows share one row of weight scales
            a = quantized_vector(a, BLOCK_K, GROUP)
            a *= tl.load(w_scale + (n0 // GROUP) * stride_sn + k // GROUP, mask=k_ok, other=0.0)
        b = tl.load(w + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        acc += b.to(tl.float32) * a[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out + t * stride_om + n, y.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _quantize_groups(x, q, scales, M, K, stride_xm, stride_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """Token t's GROUPS groups from group program_id(1) * GROUPS: e4m3 values and one scale each (tokens past
    M, the padding, are zeros)."""
    t = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = k < K
    a = tl.load(x + t * stride_xm + k, mask=k < tl.where(t < M, K, 0), other=0.0).to(tl.float32)
    values, scale = quantized_rows(a)
    tl.store(q + t * K + k, values, mask=ok)
    tl.store(scales + g * stride_sg + t, scale, mask=g * GROUP < K)


class GemvConfig(NamedTuple):
    block_n: int  # divides BLOCK, so a program's rows share one row of weight scales
    block_k: int  # a multiple of BLOCK
    num_warps: int


GEMV_CONFIG = GemvConfig(16, 512, 4)


def quantize_activations(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_activations on the GPU in one kernel, padded with zero rows to `rows`; the scales [rows,
    groups] are stored token-fastest, as cuBLAS reads them."""
    m, k = x.shape
    rows = rows or m
    groups = triton.cdiv(k, BLOCK)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    per_program = 4
    _quantize_groups[(rows, triton.cdiv(groups, per_program))](x, q, scales, m, k, x.stride(0), scales.stride(1),
                                                                 BLOCK, per_program)  # fmt: skip
    return q, scales


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, config: GemvConfig = GEMV_CONFIG) -> torch.Tensor:
    """x [T, K] times w^T (+ bias): `_gemv` for an Fp8Weight and few tokens, cuBLAS's FP8 GEMM for more, cuBLAS
    for a plain weight."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if m <= GEMV_MAX_TOKENS or k % (4 * BLOCK) or w.weight.shape[0] % 16:
        return gemv(x, w, bias, config)
    if not x.is_cuda:  # Triton's CPU interpreter: no cuBLAS, the same arithmetic in torch
        return reference_linear(x, w, bias)
    q, scales = quantize_activations(x, -(-m // 16) * 16)
    out = F.scaled_mm(q, w.weight.t(), scales, ScalingType.BlockWise1x128, w.scale.t(), ScalingType.BlockWise128x128,
                      bias=bias, output_dtype=x.dtype)  # fmt: skip
    return out[:m]


def gemv(x: torch.Tensor, w, bias: torch.Tensor | None = None, config: GemvConfig = GEMV_CONFIG) -> torch.Tensor:
    """`_gemv` for an Fp8Weight or a plain weight [N, K] (rows contiguous)."""
    fp8 = isinstance(w, Fp8Weight)
    weight, scale = (w.weight, w.scale) if fp8 else (w, w)
    m, k = x.shape
    n = weight.shape[0]
    assert BLOCK % config.block_n == 0 and config.block_k % BLOCK == 0 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(n, config.block_n), m)](
        x, weight, scale, bias if bias is not None else out, out, n, k, x.stride(0), weight.stride(0),
        scale.stride(0), out.stride(0), fp8, bias is not None, BLOCK, config.block_n, config.block_k,
        num_warps=config.num_warps,
    )  # fmt: skip
    return out

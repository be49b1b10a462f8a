"""Linear layers on the GPU, for plain (bf16) and block-scaled FP8 weights (kernels/fp8.py says what FP8
computes), and the FP8 helpers the fused MoE kernels share.

- Plain weights: cuBLAS at every size (it beat a Triton GEMV on the 35B-A3B projections: bench/RESULTS.md,
  "Linear layers").
- FP8 weights, up to GEMV_MAX_TOKENS tokens: `_gemv` reads the weight as e4m3 bytes; it quantizes the
  activations per group of 128 as it loads them and folds the weight's block scales into them, never
  dequantizing the weight in memory. Layers with few output rows split K over more programs so every SM reads.
- FP8 weights, more tokens: the activations are quantized per token and group (`_quantize_groups`, one kernel)
  and cuBLAS's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm: 1x128 activation blocks, 128x128 weight
  blocks) runs on the e4m3 tensor cores. It takes 16-aligned token counts (the activations are padded with zero
  rows) and whole sets of 4 scale groups (K a multiple of 512): a layer that has not those runs `_gemv` at any
  size, one program per token.
None synchronises with the host, so CUDA graphs capture them."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.functional import ScalingType

from deltamesh.kernels.fp8 import BLOCK, Fp8Weight, reference_linear

# FP8 weights: up to this many tokens `_gemv` runs, past it cuBLAS's FP8 GEMM wins (bench/RESULTS.md, "Linear
# layers").
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
def _gemv(
    x,
    w,
    w_scale,
    bias,
    out,
    partials,
    arrivals,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out[t, rows] = x[t] @ w[rows]^T (+ bias) for a block of BLOCK_N rows and token t = program_id(2).

    With SPLIT_K > 1, program_id(1) takes one slice of K (layers with few output rows need the extra programs
    to keep every SM reading). Each slice stores its float32 sums in `partials`; the last slice to arrive at a
    block of rows adds them up in slice order, so the result does not depend on arrival order, and resets the
    block's counter in `arrivals` for the next call."""
    pid_n, split, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole BLOCK_Ks, so FP8 groups stay whole
    k_stop = tl.minimum(split * k_per_split + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(split * k_per_split, k_stop, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(x + t * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:  # BLOCK_N divides GROUP: the program's rows share one row of weight scales
            a = quantized_vector(a, BLOCK_K, GROUP)
            a *= tl.load(w_scale + (n0 // GROUP) * stride_sn + k // GROUP, mask=k_ok, other=0.0)
        b = tl.load(w + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += b.to(tl.float32) * a[None, :]
    y = tl.sum(acc, 1)
    if SPLIT_K == 1:
        _store_row(y, bias, out + t * stride_om, n, n_ok, HAS_BIAS)
    else:
        counter = arrivals + t * tl.num_programs(0) + pid_n
        tl.store(partials + (split * tl.num_programs(2) + t) * N + n, y, mask=n_ok)
        tl.debug_barrier()  # every thread's sums are stored before the arrival is counted
        if tl.atomic_add(counter, 1) == SPLIT_K - 1:  # acq_rel: the other slices' sums are visible
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                y += tl.load(
                    partials + (s * tl.num_programs(2) + t) * N + n, mask=n_ok, other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(counter, 0)
            _store_row(y, bias, out + t * stride_om, n, n_ok, HAS_BIAS)


@triton.jit
def _store_row(y, bias, out_row, n, n_ok, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_row + n, y.to(out_row.dtype.element_ty), mask=n_ok)


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
    split_k: int  # slices of K, each its own program
    num_warps: int


# BLOCK_N rows by BLOCK_K columns per program: its float32 sums are 64 registers per thread at 4 warps.
GEMV_TILE = (16, 512)
# K is split until a layer has this many programs per SM (or a slice would be under two BLOCK_Ks).
GEMV_PROGRAMS_PER_SM = 2
ARRIVAL_COUNTERS = 4096  # blocks of rows times tokens a split call may have


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    # Triton's CPU interpreter: a handful, so tests split K as a GPU does for narrow layers
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def gemv_config(
    m: int,
    n: int,
    k: int,
    device: torch.device,
    programs_per_sm: int = GEMV_PROGRAMS_PER_SM,
    tile: tuple[int, int] = GEMV_TILE,
) -> GemvConfig:
    """The GEMV's launch for m tokens of a layer [n, k]: one program per token and block of rows, K split while
    there are too few of them to keep every SM reading."""
    block_n, block_k = tile
    programs = triton.cdiv(n, block_n) * m
    split = 1
    while (
        programs * split < programs_per_sm * _multiprocessors(device)
        and k >= 4 * split * block_k
        and programs <= ARRIVAL_COUNTERS
    ):
        split *= 2
    return GemvConfig(block_n, block_k, split, 4)


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """Per token and block of rows, how many K slices have stored their sums; each call's last slice sets it back
    to 0."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the split-K GEMV's counters must exist before CUDA graph capture: run it eagerly first")
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def quantize_activations(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_activations on the GPU in one kernel, padded with zero rows to `rows`; the scales [rows,
    groups] are stored token-fastest, as cuBLAS reads them."""
    m, k = x.shape
    rows = rows or m
    groups = triton.cdiv(k, BLOCK)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    per_program = 4
    _quantize_groups[(rows, triton.cdiv(groups, per_program))](
        x, q, scales, m, k, x.stride(0), scales.stride(1), BLOCK, per_program
    )
    return q, scales


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] times w^T (+ bias): cuBLAS for a plain weight; for an Fp8Weight, `_gemv` up to GEMV_MAX_TOKENS
    tokens (or at any size where the layer's shape does not suit cuBLAS's FP8 GEMM), `fp8_gemm` past it."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[0] <= GEMV_MAX_TOKENS or not fits_fp8_gemm(x, w):
        return gemv(x, w, bias)
    return fp8_gemm(x, w, bias)


def fits_fp8_gemm(x: torch.Tensor, w: Fp8Weight) -> bool:
    """cuBLAS's block-scaled FP8 GEMM takes whole sets of 4 scale groups and 16-aligned output rows."""
    return x.shape[1] % (4 * BLOCK) == 0 and w.weight.shape[0] % 16 == 0


def fp8_gemm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The activations quantized per token and group, then cuBLAS's block-scaled FP8 GEMM (the tokens padded to
    a multiple of 16); x rows contiguous, the shapes as fits_fp8_gemm says."""
    if not x.is_cuda:  # Triton's CPU interpreter: no cuBLAS, the same arithmetic in torch
        return reference_linear(x, w, bias)
    m = x.shape[0]
    q, scales = quantize_activations(x, -(-m // 16) * 16)
    out = F.scaled_mm(
        q,
        w.weight.t(),
        scales,
        ScalingType.BlockWise1x128,
        w.scale.t(),
        ScalingType.BlockWise128x128,
        bias=bias,
        output_dtype=x.dtype,
    )
    return out[:m]


def gemv(x: torch.Tensor, w, bias: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """`_gemv` for an Fp8Weight or a plain weight [N, K] (rows contiguous); x [T, K] (rows contiguous), any T."""
    fp8 = isinstance(w, Fp8Weight)
    weight, scale = (w.weight, w.scale) if fp8 else (w, w)
    m, k = x.shape
    n = weight.shape[0]
    config = config or gemv_config(m, n, k, x.device)
    assert BLOCK % config.block_n == 0 and config.block_k % BLOCK == 0 and weight.stride(1) == 1 and x.stride(1) == 1
    blocks = triton.cdiv(n, config.block_n)
    assert config.split_k == 1 or blocks * m <= ARRIVAL_COUNTERS
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:  # a data-parallel rank without tokens
        return out
    split = config.split_k > 1
    partials = torch.empty(config.split_k, m, n, dtype=torch.float32, device=x.device) if split else out
    arrivals = _arrivals(x.device) if split else out
    _gemv[(blocks, config.split_k, m)](
        x,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        partials,
        arrivals,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        fp8,
        bias is not None,
        BLOCK,
        config.block_n,
        config.block_k,
        config.split_k,
        num_warps=config.num_warps,
    )
    return out

"""Linear layers on the GPU, for plain (bf16) and block-scaled FP8 weights (kernels/fp8.py says what FP8
computes), and the FP8 helpers the fused MoE kernels share.

- Plain weights: cuBLAS at every size (a Triton GEMV that reads each weight tile once for 1-4 tokens did not
  beat cuBLAS's own kernels on the 35B-A3B projections: bench/RESULTS.md, "Linear layers").
- FP8 weights, up to GEMV_MAX_TOKENS tokens: `_gemv` reads the weight as e4m3 bytes; it quantizes the
  activations per group of 128 as it loads them and folds the weight's block scales into them, never
  dequantizing the weight in memory. Layers with few output rows split K over more programs so every SM reads.
- FP8 weights, more tokens: the activations are quantized per token and group (`_quantize_groups`, one kernel)
  and cuBLAS's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm: 1x128 activation blocks, 128x128 weight
  blocks) runs on the e4m3 tensor cores. It takes 16-aligned token counts (the activations are padded with zero
  rows) and whole sets of 4 scale groups (K a multiple of 512): a layer that has not those runs `_gemv` at any
  size, each program reading its weight tile once for a chunk of GEMV_CHUNK_TOKENS tokens.
None synchronises with the host, so CUDA graphs capture them."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.functional import ScalingType
import triton
import triton.language as tl

from deltamesh.kernels.fp8 import BLOCK, Fp8Weight, reference_linear

# FP8 weights: up to this many tokens `_gemv` runs, past it cuBLAS's FP8 GEMM wins (bench/RESULTS.md, "Linear
# layers").
GEMV_MAX_TOKENS = 1
# Tokens one `_gemv` program takes at once (a power of two), past GEMV_MAX_TOKENS.
GEMV_CHUNK_TOKENS = 4


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
def _gemv(x, w, w_scale, bias, out, partials, arrivals, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
          FP8: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, M_PAD: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """out[tokens, rows] = x[tokens] @ w[rows]^T (+ bias) for a block of BLOCK_N rows and a chunk of M_PAD
    tokens (program_id(2)), each weight tile read once for the chunk.

    With SPLIT_K > 1, program_id(1) takes one slice of K (layers with few output rows need the extra programs
    to keep every SM reading). Each slice stores its float32 sums in `partials`; the last slice to arrive at a
    block of rows adds them up in slice order, so the result does not depend on arrival order, and resets the
    block's counter in `arrivals` for the next call."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.program_id(2) * M_PAD + tl.arange(0, M_PAD)  # this chunk's tokens
    m_ok = m < M
    kk = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole BLOCK_Ks, so FP8 groups stay whole
    k_stop = tl.minimum(split * k_per_split + k_per_split, K)
    if M_PAD == 1:  # one token: the activations a vector, the sums [BLOCK_N, BLOCK_K] (faster code than 3-D)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(split * k_per_split, k_stop, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            a = tl.load(x + tl.program_id(2) * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            if FP8:  # BLOCK_N divides GROUP: the program's rows share one row of weight scales
                a = quantized_vector(a, BLOCK_K, GROUP)
                a *= tl.load(w_scale + (n0 // GROUP) * stride_sn + k // GROUP, mask=k_ok, other=0.0)
            b = tl.load(w + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            acc += b.to(tl.float32) * a[None, :]
        y = tl.reshape(tl.sum(acc, 1), (1, BLOCK_N))
    else:
        acc3 = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(split * k_per_split, k_stop, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            a = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a = a.to(tl.float32)
            if FP8:
                q, scale = quantized_rows(tl.reshape(a, (M_PAD * BLOCK_K // GROUP, GROUP)))
                a = tl.reshape(q.to(tl.float32) * scale[:, None], (M_PAD, BLOCK_K))
                a *= tl.load(w_scale + (n0 // GROUP) * stride_sn + k // GROUP, mask=k_ok, other=0.0)[None, :]
            b = tl.load(w + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            acc3 += b.to(tl.float32)[None, :, :] * a[:, None, :]
        y = tl.sum(acc3, 2)
    if SPLIT_K == 1:
        _store_rows(y, bias, out, m, n, m_ok, n_ok, stride_om, HAS_BIAS)
    else:  # one chunk of tokens
        mn = m[:, None] * N + n[None, :]
        mn_ok = m_ok[:, None] & n_ok[None, :]
        tl.store(partials + split * M_PAD * N + mn, y, mask=mn_ok)
        tl.debug_barrier()  # every thread's sums are stored before the arrival is counted
        if tl.atomic_add(arrivals + pid_n, 1) == SPLIT_K - 1:  # acq_rel: the other slices' sums are visible
            y = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                y += tl.load(partials + s * M_PAD * N + mn, mask=mn_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals + pid_n, 0)
            _store_rows(y, bias, out, m, n, m_ok, n_ok, stride_om, HAS_BIAS)


@triton.jit
def _store_rows(y, bias, out, m, n, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + m[:, None] * stride_om + n[None, :], y.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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


# Tiles per padded token count: each keeps M_PAD * BLOCK_N * BLOCK_K float32 sums (64 per thread at 4 warps).
GEMV_TILES = {1: (16, 512), 2: (8, 512), 4: (8, 256)}
# K is split until a layer has this many programs per SM (or a slice would be under two BLOCK_Ks).
GEMV_PROGRAMS_PER_SM = 2


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    # Triton's CPU interpreter: a handful, so tests split K as a GPU does for narrow layers
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def gemv_config(m: int, n: int, k: int, device: torch.device, programs_per_sm: int = GEMV_PROGRAMS_PER_SM,
                tiles: dict[int, tuple[int, int]] = GEMV_TILES) -> GemvConfig:  # fmt: skip
    """The GEMV's tile for m tokens: up to GEMV_CHUNK_TOKENS, one program reads its rows for all of them, with K
    split for narrow layers; more tokens run in chunks of GEMV_CHUNK_TOKENS, unsplit."""
    block_n, block_k = tiles[_padded(m)]
    blocks = triton.cdiv(n, block_n)
    split = 1
    while (m <= GEMV_CHUNK_TOKENS and blocks * split < programs_per_sm * _multiprocessors(device)
           and k >= 4 * split * block_k):  # fmt: skip
        split *= 2
    return GemvConfig(block_n, block_k, split, 4)


def _padded(m: int) -> int:
    return 1 << (min(m, GEMV_CHUNK_TOKENS) - 1).bit_length()


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """Per block of rows, how many K slices have stored their sums; each call's last slice sets it back to 0."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the split-K GEMV's counters must exist before CUDA graph capture: run it eagerly first")
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


ARRIVAL_COUNTERS = 4096


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


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] times w^T (+ bias): cuBLAS for a plain weight; for an Fp8Weight, `_gemv` up to GEMV_MAX_TOKENS
    tokens (or at any size where the layer's shape does not suit cuBLAS's FP8 GEMM), that GEMM past it."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if m <= GEMV_MAX_TOKENS or k % (4 * BLOCK) or w.weight.shape[0] % 16:
        return gemv(x, w, bias)
    if not x.is_cuda:  # Triton's CPU interpreter: no cuBLAS, the same arithmetic in torch
        return reference_linear(x, w, bias)
    q, scales = quantize_activations(x, -(-m // 16) * 16)
    out = F.scaled_mm(q, w.weight.t(), scales, ScalingType.BlockWise1x128, w.scale.t(), ScalingType.BlockWise128x128,
                      bias=bias, output_dtype=x.dtype)  # fmt: skip
    return out[:m]


def gemv(x: torch.Tensor, w, bias: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """`_gemv` for an Fp8Weight or a plain weight [N, K] (rows contiguous); x [T, K] (rows contiguous) for any T,
    in chunks of GEMV_CHUNK_TOKENS."""
    fp8 = isinstance(w, Fp8Weight)
    weight, scale = (w.weight, w.scale) if fp8 else (w, w)
    m, k = x.shape
    n = weight.shape[0]
    config = config or gemv_config(m, n, k, x.device)
    m_pad = _padded(max(m, 1))
    assert BLOCK % config.block_n == 0 and config.block_k % BLOCK == 0 and weight.stride(1) == 1 and x.stride(1) == 1
    blocks, chunks = triton.cdiv(n, config.block_n), triton.cdiv(m, m_pad)
    assert config.split_k == 1 or (chunks == 1 and blocks <= ARRIVAL_COUNTERS)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:  # a data-parallel rank without tokens
        return out
    split = config.split_k > 1
    partials = torch.empty(config.split_k, m_pad, n, dtype=torch.float32, device=x.device) if split else out
    arrivals = _arrivals(x.device) if split else out
    _gemv[(blocks, config.split_k, chunks)](
        x, weight, scale, bias if bias is not None else out, out, partials, arrivals, m, n, k, x.stride(0),
        weight.stride(0), scale.stride(0), out.stride(0), fp8, bias is not None, BLOCK, m_pad, config.block_n,
        config.block_k, config.split_k, num_warps=config.num_warps,
    )  # fmt: skip
    return out

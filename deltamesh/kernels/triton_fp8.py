"""A linear layer with block-scaled FP8 weights in Triton (kernels/fp8.py says what it computes), for the shared
expert of an FP8 MoE layer outside the pair-wise path: one kernel quantizes each [BLOCK_M, 128] tile of
activations per token as it loads it, multiplies it with the weight's e4m3 tile on the tensor cores and applies
both scales to the float32 partial sum; no separate quantization kernel, no host synchronisation (CUDA graphs
capture it). Plain weights go to cuBLAS. The model's other projections stay in bf16: this kernel is slower than
cuBLAS's bf16 GEMM at every size measured (bench/gpu_fp8.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltamesh.kernels.fp8 import BLOCK, Fp8Weight


@triton.jit
def _fp8_matmul(x, w, w_scale, bias, out, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    kk = tl.arange(0, GROUP)
    scales = w_scale + (pid_n * BLOCK_N // GROUP) * stride_sn  # BLOCK_N divides GROUP: one row of scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, GROUP):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(x + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        a_scale = tl.maximum(tl.max(tl.abs(a), 1), 1e-10) / 448.0  # fp8.E4M3_MAX
        a_q = (a / a_scale[:, None]).to(tl.float8e4nv)
        b = tl.load(w + n[None, :].to(tl.int64) * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # fmt: skip
        if FP8_DOT:
            part = tl.dot(a_q, b)
        else:  # e4m3 values are exact in bf16: the same products on the bf16 tensor cores
            part = tl.dot(a_q.to(tl.bfloat16), b.to(tl.bfloat16))
        acc += part * (a_scale[:, None] * tl.load(scales + k0 // GROUP))
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


class Fp8Config(NamedTuple):
    block_m: int
    block_n: int  # divides BLOCK, so a tile's rows share one weight scale per group
    num_warps: int = 4
    num_stages: int = 3
    fp8_dot: bool = True


def fp8_config(m: int) -> Fp8Config:
    """Tiles by the number of tokens, the fastest of `bench/gpu_fp8.py --sweep` (bench/RESULTS.md)."""
    if m <= 16:
        return Fp8Config(16, 64, num_warps=4, num_stages=3)
    return Fp8Config(64, 64, num_warps=8, num_stages=3)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, config: Fp8Config | None = None) -> torch.Tensor:
    """x [T, K] times w^T (+ bias): the Triton kernel for an Fp8Weight, cuBLAS for a plain weight."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w.weight.shape[0]
    cfg = config or fp8_config(M)
    assert BLOCK % cfg.block_n == 0 and w.weight.shape[1] == K and w.weight.stride(1) == 1
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m))
    _fp8_matmul[grid](
        x, w.weight, w.scale, bias if bias is not None else out, out, M, N, K, x.stride(0), w.weight.stride(0),
        w.scale.stride(0), out.stride(0), bias is not None, cfg.fp8_dot, BLOCK, cfg.block_m, cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


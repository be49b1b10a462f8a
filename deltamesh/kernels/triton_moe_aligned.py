"""The fused MoE layer's aligned path (triton_moe.py chooses it past a few tokens): six kernels, the (token,
choice) pairs grouped by expert into blocks of BLOCK_M rows for `tl.dot`:
1. `_route`: per token, softmax over the router logits, top-k (renormalised if the model says so), and for each
   chosen expert a rank among that expert's (token, choice) pairs, taken with an atomic counter.
2. `_align`: one program turns the per-expert counts into segments of the sorted pair order, each padded to a
   multiple of BLOCK_M, and names the expert of every block of BLOCK_M sorted rows.
3. `_scatter`: writes each pair's index at its sorted row (segment start + rank). Rows past an expert's count are
   padding; the GEMM kernels mask them by the count, so the sorted buffer needs no fill.
4. `_gate_up_silu`: per block of one expert's rows, gate and up projections (two accumulators over the
   hidden size) and silu(gate) * up, into an intermediate buffer in sorted-row order.
5. `_down`: per block, the down projection times the pair's routing weight, written at the pair's own row of a
   [tokens * top_k, hidden] buffer.
6. `_combine`: per token, the sum of its top_k rows plus the gated shared expert's output (computed before by
   two cuBLAS GEMMs around a fused silu-mul: triton_moe.moe).

Rows within a block are computed independently, so a pair's result does not depend on where the atomic rank
put it: the output is deterministic.

FP8 weights: x is quantized once before the GEMMs, and the gate/up kernel writes the SwiGLU output already
quantized (each program computes one group of output columns), so both GEMMs read e4m3 tiles and their scales and
multiply on the tensor cores, one K step per scale group.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltamesh.kernels import pdl, triton_linear
from deltamesh.kernels.fp8 import BLOCK, kernel_operands
from deltamesh.kernels.triton_gemv_kernels import quantized_rows
from deltamesh.kernels.triton_pdl import pdl_wait

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _route(
    logits,
    ids,
    weights,
    ranks,
    counts,
    stride_l,
    first,
    local,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """ids: the choice's expert among this rank's [first, first + local), -1 for another rank's."""
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits + t * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        e = tl.min(tl.where(p == best, offs, BLOCK_E), 0)  # the first index of the largest, as torch.topk
        mine = (e >= first) & (e < first + local)
        tl.store(ids + t * TOP_K + j, tl.where(mine, e - first, -1))
        tl.store(weights + t * TOP_K + j, best)
        tl.store(ranks + t * TOP_K + j, tl.atomic_add(counts + tl.where(mine, e - first, 0), tl.where(mine, 1, 0)))
        total += best
        p = tl.where(offs == e, -1.0, p)
    if NORM:
        for j in tl.static_range(TOP_K):
            w = tl.load(weights + t * TOP_K + j)
            tl.store(weights + t * TOP_K + j, w / total)


@triton.jit
def _align(
    counts,
    starts,
    block_expert,
    max_blocks,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    offs = tl.arange(0, BLOCK_E)
    c = tl.load(counts + offs, mask=offs < E, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts + offs, ends - padded, mask=offs < E)
    total = tl.sum(padded, 0)
    ends = tl.where(offs < E, ends, total + 1)  # lanes past E never count below a used block
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        row = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), 1)  # segments that end at or before row
        tl.store(block_expert + b, tl.where(row < total, expert, -1), mask=b < max_blocks)


@triton.jit
def _scatter(ids, ranks, starts, sorted_pairs, P, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = p < P
    e = tl.load(ids + p, mask=mask, other=-1)
    mask &= e >= 0  # another rank's expert: not this rank's pair
    row = tl.load(starts + e, mask=mask, other=0) + tl.load(ranks + p, mask=mask, other=0)
    tl.store(sorted_pairs + row, p, mask=mask)


@triton.jit
def _block_rows(block_expert, starts, counts, sorted_pairs, BLOCK_M: tl.constexpr):
    """(expert, sorted rows, which are real pairs, their pair indices) of this program's block; expert < 0: none."""
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    e_safe = tl.maximum(e, 0)
    end = tl.load(starts + e_safe) + tl.load(counts + e_safe)
    valid = rows < tl.where(e >= 0, end, 0)
    pairs = tl.load(sorted_pairs + rows, mask=valid, other=0)
    return e, rows, valid, pairs


@triton.jit
def _gate_up_silu(
    x,
    x_s,
    w13,
    w13_s,
    inter,
    inter_s,
    block_expert,
    starts,
    counts,
    sorted_pairs,
    H,
    I,
    stride_x,
    stride_xs_t,
    stride_xs_g,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_is,
    TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """FP8: x holds e4m3 activations with their scales in x_s [tokens, groups]; BLOCK_K and BLOCK_N are the scale
    group, so each program writes one group of its rows' SwiGLU output, quantized (inter_s: its scales)."""
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    e, rows, valid, pairs = _block_rows(block_expert, starts, counts, sorted_pairs, BLOCK_M)
    if e < 0:
        return
    tokens = pairs // TOP_K
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w13 + e.to(tl.int64) * stride_we
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        a = tl.load(
            x + tokens[:, None].to(tl.int64) * stride_x + k[None, :], mask=valid[:, None] & (k[None, :] < H), other=0.0
        )
        w_mask = (k[:, None] < H) & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w + (n[None, :] + I) * stride_wn + k[:, None], mask=w_mask, other=0.0)
        if FP8:
            a_s = tl.load(
                x_s + tokens.to(tl.int64) * stride_xs_t + (k0 // BLOCK_K) * stride_xs_g, mask=valid, other=0.0
            )
            s = w13_s + e.to(tl.int64) * stride_se + k0 // BLOCK_K
            gate += tl.dot(a, wg) * (a_s[:, None] * tl.load(s + (n0 // BLOCK_K) * stride_sn))
            up += tl.dot(a, wu) * (a_s[:, None] * tl.load(s + ((n0 + I) // BLOCK_K) * stride_sn))
        else:
            gate = tl.dot(a, wg, gate)
            up = tl.dot(a, wu, up)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = inter + rows[:, None].to(tl.int64) * I + n[None, :]
    if FP8:  # rounded to the model dtype first, as the reference's down projection reads it
        q, scale = quantized_rows(h.to(MODEL_DTYPE).to(tl.float32))
        tl.store(out, q, mask=valid[:, None] & n_ok[None, :])
        tl.store(inter_s + rows.to(tl.int64) * stride_is + n0 // BLOCK_N, scale, mask=valid)
    else:
        tl.store(out, h.to(inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down(
    inter,
    inter_s,
    w2,
    w2_s,
    out,
    weights,
    block_expert,
    starts,
    counts,
    sorted_pairs,
    H,
    I,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_is,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """FP8: inter holds the e4m3 SwiGLU outputs, inter_s their scales per group of BLOCK_K."""
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    e, rows, valid, pairs = _block_rows(block_expert, starts, counts, sorted_pairs, BLOCK_M)
    if e < 0:
        return
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w = w2 + e.to(tl.int64) * stride_we
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        a = tl.load(
            inter + rows[:, None].to(tl.int64) * I + k[None, :], mask=valid[:, None] & (k[None, :] < I), other=0.0
        )
        b = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=(k[:, None] < I) & n_ok[None, :], other=0.0)
        if FP8:
            a_s = tl.load(inter_s + rows.to(tl.int64) * stride_is + k0 // BLOCK_K, mask=valid, other=0.0)
            w_s = tl.load(w2_s + e.to(tl.int64) * stride_se + (n0 // BLOCK_K) * stride_sn + k0 // BLOCK_K)
            acc += tl.dot(a, b) * (a_s[:, None] * w_s)
        else:
            acc = tl.dot(a, b, acc)
    acc = acc * tl.load(weights + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        out + pairs[:, None].to(tl.int64) * H + n[None, :],
        acc.to(out.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )


@triton.jit
def _combine(
    pairs_out,
    ids,
    shared,
    gate,
    out,
    H,
    stride_s,
    stride_g,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """out[t] = sum of the token's TOP_K pair rows (this rank's experts') + sigmoid(gate[t]) * shared[t]."""
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        mine = tl.load(ids + t * TOP_K + j) >= 0  # else another rank's expert: its row was never written
        acc += tl.load(pairs_out + (t * TOP_K + j) * H + h, mask=h < tl.where(mine, H, 0), other=0.0).to(tl.float32)
    g = tl.sigmoid(tl.load(gate + t * stride_g).to(tl.float32))
    acc += g * tl.load(shared + t * stride_s + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * H + h, acc.to(out.dtype.element_ty), mask=ok)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def gemm_config(num_pairs: int) -> GemmConfig:
    """Small row blocks while pairs are few (decode: an expert gets a handful of rows, padding them to 64 would
    waste the GEMM), larger ones for prefill; the best of `bench/gpu_moe.py --sweep` (bench/RESULTS.md)."""
    if num_pairs <= 2048:
        return GemmConfig(16, 64, 128, num_warps=4, num_stages=4)
    if num_pairs <= 16384:
        return GemmConfig(64, 128, 64)
    return GemmConfig(128, 128, 64, num_warps=8)


def moe_aligned(
    x, router_logits, w13, w2, top_k, norm_topk, shared, shared_gate, config, first_expert=0
) -> torch.Tensor:
    """triton_moe.moe's output on the aligned path, given the shared expert's output (before its gate)."""
    (w13, w13_s, fp8), (w2, w2_s, _) = kernel_operands(w13), kernel_operands(w2)
    T, H = x.shape
    E, two_i, _ = w13.shape  # this rank's experts; the router's logits cover every expert
    I = two_i // 2
    P = T * top_k
    dev = x.device
    cfg = config or gemm_config(P)
    if fp8:  # one K step per scale group, and gate/up's programs one group of output columns each
        cfg = cfg._replace(block_n=BLOCK, block_k=BLOCK)
    BLOCK_M, BLOCK_N, BLOCK_K = cfg.block_m, cfg.block_n, cfg.block_k
    tuning = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    BLOCK_E = triton.next_power_of_2(E)
    # every used expert's segment may end in a partly filled block, and at most min(E, P) experts are used
    max_blocks = triton.cdiv(P, BLOCK_M) + min(E, P)

    ids = torch.empty(P, dtype=torch.int32, device=dev)
    weights = torch.empty(P, dtype=torch.float32, device=dev)
    ranks = torch.empty(P, dtype=torch.int32, device=dev)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    starts = torch.empty(E, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(max_blocks * BLOCK_M, dtype=torch.int32, device=dev)
    if fp8:  # the activations quantized once, not by every program that reads them
        xq, xs = triton_linear.quantize_activations(x)
        inter = torch.empty(max_blocks * BLOCK_M, I, dtype=torch.float8_e4m3fn, device=dev)
        inter_s = torch.empty(max_blocks * BLOCK_M, triton.cdiv(I, BLOCK), dtype=torch.float32, device=dev)
    else:  # (the scale arguments are never read)
        xq, xs = x, x
        inter = torch.empty(max_blocks * BLOCK_M, I, dtype=x.dtype, device=dev)
        inter_s = inter
    pairs_out = torch.empty(P, H, dtype=x.dtype, device=dev)
    out = torch.empty(T, H, dtype=x.dtype, device=dev)

    E_all = router_logits.shape[1]
    _route[(T,)](
        router_logits,
        ids,
        weights,
        ranks,
        counts,
        router_logits.stride(0),
        first_expert,
        E,
        E_all,
        triton.next_power_of_2(E_all),
        top_k,
        norm_topk,
        **pdl.kwargs(dev),
    )
    _align[(1,)](counts, starts, block_expert, max_blocks, E, BLOCK_E, BLOCK_M, 64, **pdl.kwargs(dev))
    _scatter[(triton.cdiv(P, 256),)](ids, ranks, starts, sorted_pairs, P, 256, **pdl.kwargs(dev))
    _gate_up_silu[(max_blocks, triton.cdiv(I, BLOCK_N))](
        xq,
        xs,
        w13,
        w13_s,
        inter,
        inter_s,
        block_expert,
        starts,
        counts,
        sorted_pairs,
        H,
        I,
        xq.stride(0),
        xs.stride(0),
        xs.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13_s.stride(0),
        w13_s.stride(1),
        inter_s.stride(0),
        top_k,
        fp8,
        TL_DTYPES[x.dtype],
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        **tuning,
        **pdl.kwargs(dev),
    )
    _down[(max_blocks, triton.cdiv(H, BLOCK_N))](
        inter,
        inter_s,
        w2,
        w2_s,
        pairs_out,
        weights,
        block_expert,
        starts,
        counts,
        sorted_pairs,
        H,
        I,
        w2.stride(0),
        w2.stride(1),
        w2_s.stride(0),
        w2_s.stride(1),
        inter_s.stride(0),
        fp8,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        **tuning,
        **pdl.kwargs(dev),
    )
    _combine[(T, triton.cdiv(H, 1024))](
        pairs_out,
        ids,
        shared,
        shared_gate,
        out,
        H,
        shared.stride(0),
        shared_gate.stride(0),
        top_k,
        1024,
        **pdl.kwargs(dev),
    )
    return out

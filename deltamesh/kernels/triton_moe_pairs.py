"""The fused MoE layer's pair-wise path (triton_moe.py chooses it for a few tokens: a decode step): every
(token, choice) pair reads its expert's weights directly, so no alignment is needed, and the shared expert is one
more pair per token. Two kernels:
1. `_gate_up_silu_pairs`: per pair and block of intermediate columns, the token's routing (softmax, top-k,
   renormalised if the model says so; the shared pair's weight is sigmoid of its gate), then gate and up
   projections as dot products over the hidden size and silu(gate) * up.
2. `_down_combine`: per token and block of hidden columns, the down projections of all its pairs, each times
   its routing weight, summed: the layer's output.

FP8 weights: the activation vector is quantized as it is loaded, and each group's two scales folded into it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltamesh.kernels import pdl
from deltamesh.kernels.fp8 import BLOCK, kernel_operands
from deltamesh.kernels.triton_gemv_kernels import quantized_vector
from deltamesh.kernels.triton_pdl import pdl_wait


@triton.jit
def _choice(logits, t, j, stride_l, E: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr):
    """(expert, routing weight) of token t's j-th choice, as `_route` picks them."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits + t * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    total = 0.0
    expert = 0
    weight = 0.0
    for i in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        e = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        expert = tl.where(i == j, e, expert)
        weight = tl.where(i == j, best, weight)
        total += best
        p = tl.where(offs == e, -1.0, p)
    if NORM:
        weight = weight / total
    return expert, weight


@triton.jit
def _gate_up_silu_pairs(
    x,
    logits,
    shared_gate,
    w13,
    sw13,
    w13_s,
    sw13_s,
    inter,
    ids,
    weights,
    H,
    I,
    IS,
    stride_x,
    stride_l,
    stride_g,
    stride_we,
    stride_wn,
    stride_swn,
    stride_se,
    stride_sn,
    stride_ssn,
    first,
    local,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    pair = tl.program_id(0)  # token * (TOP_K + 1) + choice; choice TOP_K is the shared expert
    t, j = pair // (TOP_K + 1), pair % (TOP_K + 1)
    if j < TOP_K:  # ids: the expert among this rank's [first, first + local), -2 for another rank's
        e, weight = _choice(logits, t, j, stride_l, E, BLOCK_E, TOP_K, NORM)
        e -= first
        mine = (e >= 0) & (e < local)
        e, weight = tl.where(mine, e, -2), tl.where(mine, weight, 0.0)
        w, stride_n, width = w13 + tl.maximum(e, 0).to(tl.int64) * stride_we, stride_wn, tl.where(mine, I, 0)
        s, s_stride_n = w13_s + tl.maximum(e, 0).to(tl.int64) * stride_se, stride_sn
    else:
        e, weight = -1, tl.sigmoid(tl.load(shared_gate + t * stride_g).to(tl.float32))
        w, stride_n, width = sw13, stride_swn, IS
        s, s_stride_n = sw13_s, stride_ssn
    n0 = tl.program_id(1) * BLOCK_N
    if n0 == 0:
        tl.store(ids + pair, e)
        tl.store(weights + pair, weight)
    if n0 >= width:
        return
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < width
    kk = tl.arange(0, BLOCK_K)
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        k_ok = k < H
        a = tl.load(x + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        a_gate, a_up = a, a
        if FP8:  # the weight's scales (BLOCK_N rows share theirs) folded into the activations
            a = quantized_vector(a, BLOCK_K, GROUP)
            a_gate = a * tl.load(s + (n0 // GROUP) * s_stride_n + k // GROUP, mask=k_ok, other=0.0)
            a_up = a * tl.load(s + ((n0 + width) // GROUP) * s_stride_n + k // GROUP, mask=k_ok, other=0.0)
        mask = n_ok[:, None] & k_ok[None, :]
        gate += tl.load(w + n[:, None] * stride_n + k[None, :], mask=mask, other=0.0).to(tl.float32) * a_gate[None, :]
        w_up = tl.load(w + (n[:, None] + width) * stride_n + k[None, :], mask=mask, other=0.0)
        up += w_up.to(tl.float32) * a_up[None, :]
    g = tl.sum(gate, 1)
    h = g / (1.0 + tl.exp(-g)) * tl.sum(up, 1)
    tl.store(inter + pair.to(tl.int64) * tl.maximum(I, IS) + n, h.to(inter.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_combine(
    inter,
    w2,
    sw2,
    w2_s,
    sw2_s,
    ids,
    weights,
    out,
    H,
    I,
    IS,
    stride_we,
    stride_wn,
    stride_swn,
    stride_se,
    stride_sn,
    stride_ssn,
    TOP_K: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    row_len = tl.maximum(I, IS)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for j in tl.static_range(TOP_K + 1):
        pair = t * (TOP_K + 1) + j
        weight = tl.load(weights + pair)
        if j < TOP_K:  # another rank's expert (id -2): nothing to add
            e = tl.load(ids + pair).to(tl.int64)
            w, stride_n, width = w2 + tl.maximum(e, 0) * stride_we, stride_wn, tl.where(e >= 0, I, 0)
            s = w2_s + tl.maximum(e, 0) * stride_se + (n0 // GROUP) * stride_sn
        else:
            w, stride_n, width = sw2, stride_swn, IS
            s = sw2_s + (n0 // GROUP) * stride_ssn
        for k0 in range(0, width, BLOCK_K):
            k = k0 + kk
            k_ok = k < width
            a = tl.load(inter + pair.to(tl.int64) * row_len + k, mask=k_ok, other=0.0).to(tl.float32)
            if FP8:
                a = quantized_vector(a, BLOCK_K, GROUP) * tl.load(s + k // GROUP, mask=k_ok, other=0.0)
            b = tl.load(w + n[:, None] * stride_n + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += b.to(tl.float32) * (a * weight)[None, :]
    tl.store(out + t * H + n, tl.sum(acc, 1).to(out.dtype.element_ty), mask=n_ok)


class PairTile(NamedTuple):
    """One pair-wise kernel's launch: output rows per program, the K step, warps per program."""

    block_n: int
    block_k: int
    num_warps: int


class PairConfig(NamedTuple):
    gate_up: PairTile
    down: PairTile


def pair_config(tokens: int) -> PairConfig:
    """The pair-wise path's tiles, the fastest of `python bench/gpu_moe.py --sweep` (its weights come from
    HBM, as in a step): one token favours a narrow down kernel, more tokens a narrow gate/up kernel."""
    if tokens == 1:
        return PairConfig(PairTile(4, 512, 2), PairTile(2, 512, 2))
    return PairConfig(PairTile(2, 512, 1), PairTile(4, 512, 1))


def moe_pairs(
    x,
    router_logits,
    w13,
    w2,
    top_k,
    norm_topk,
    shared_w13,
    shared_w2,
    shared_gate,
    first_expert=0,
    tiles: PairConfig | None = None,
) -> torch.Tensor:
    """triton_moe.moe's output on the pair-wise path; `tiles` forces the kernels' tiles (bench/gpu_moe.py)."""
    (w13, w13_s, fp8), (w2, w2_s, _) = kernel_operands(w13), kernel_operands(w2)
    (sw13, sw13_s, _), (sw2, sw2_s, _) = kernel_operands(shared_w13), kernel_operands(shared_w2)
    T, H = x.shape
    local, two_i, _ = w13.shape
    E = router_logits.shape[1]
    I, IS = two_i // 2, sw13.shape[0] // 2
    P = T * (top_k + 1)
    dev = x.device
    ids = torch.empty(P, dtype=torch.int32, device=dev)
    weights = torch.empty(P, dtype=torch.float32, device=dev)
    inter = torch.empty(P, max(I, IS), dtype=x.dtype, device=dev)
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    gate_up, down = tiles or pair_config(T)
    _gate_up_silu_pairs[(P, triton.cdiv(max(I, IS), gate_up.block_n))](
        x,
        router_logits,
        shared_gate,
        w13,
        sw13,
        w13_s,
        sw13_s,
        inter,
        ids,
        weights,
        H,
        I,
        IS,
        x.stride(0),
        router_logits.stride(0),
        shared_gate.stride(0),
        w13.stride(0),
        w13.stride(1),
        sw13.stride(0),
        w13_s.stride(0),
        w13_s.stride(1),
        sw13_s.stride(0),
        first_expert,
        local,
        E,
        triton.next_power_of_2(E),
        top_k,
        norm_topk,
        fp8,
        BLOCK,
        gate_up.block_n,
        gate_up.block_k,
        num_warps=gate_up.num_warps,
        **pdl.kwargs(dev),
    )
    _down_combine[(T, triton.cdiv(H, down.block_n))](
        inter,
        w2,
        sw2,
        w2_s,
        sw2_s,
        ids,
        weights,
        out,
        H,
        I,
        IS,
        w2.stride(0),
        w2.stride(1),
        sw2.stride(0),
        w2_s.stride(0),
        w2_s.stride(1),
        sw2_s.stride(0),
        top_k,
        fp8,
        BLOCK,
        down.block_n,
        down.block_k,
        num_warps=down.num_warps,
        **pdl.kwargs(dev),
    )
    return out

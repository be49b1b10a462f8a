"""The GEMV of linear layers at one token (`gemv`, kernel `_gemv`), for plain and block-scaled FP8 weights
(kernels/fp8.py says what FP8 computes), with what can run in the same launch:

- a prologue on its input, the op that would otherwise be a kernel of its own just before the projection
  (`Prologue`: the attention's sigmoid output gate, GDN's gated RMSNorm, a residual add and RMSNorm);
- plain rows beside an FP8 weight (`tail`: GDN's b|a gates, which the FP8 checkpoints keep in bf16, beside its
  FP8 qkv|z projection), so a layer's projections of one input stay one launch.

FP8 weights are read as e4m3 bytes; the activations are quantized per group of 128 as they are loaded and the
weight's block scales folded into them, never dequantizing the weight in memory. Layers with few output rows split
K over more programs so every SM reads. No host synchronisation, so CUDA graphs capture it."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltamesh.kernels import pdl
from deltamesh.kernels.fp8 import BLOCK, Fp8Weight


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


# What the GEMV computes from its input before the product: each the op that otherwise runs as a kernel of its
# own just before the projection (triton_fused_linear.py): nothing; x * sigmoid(gate), the attention's output
# gate; GDN's gated RMSNorm, per head; the residual add and the RMSNorm of the whole row.
PLAIN, SIGMOID_GATE, GATED_NORM, ADD_NORM = (tl.constexpr(kind) for kind in range(4))


@triton.jit
def _activation(
    x,
    other,
    norm_w,
    t,
    k,
    k_ok,
    rstd,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    eps,
    PROLOGUE: tl.constexpr,
    HEAD: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(the product's inputs k of token t, the residual sum there) in float32: x after the PROLOGUE, rounded to
    x's dtype where the unfused op stores its output (the fused kernels of triton_fused.py round the same way).
    SIGMOID_GATE and GATED_NORM read x and `other` (the gate, z) as [T, heads, HEAD] views; ADD_NORM reads x and
    `other` (the residual) as [T, K] rows and takes the row's rstd from the caller."""
    dtype = x.dtype.element_ty
    if PROLOGUE == PLAIN:
        a = tl.load(x + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        s = a
    elif PROLOGUE == ADD_NORM:
        s = tl.load(x + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        s += tl.load(other + t * stride_ot + k, mask=k_ok, other=0.0).to(tl.float32)
        s = s.to(dtype).to(tl.float32)
        a = s * rstd * (1.0 + tl.load(norm_w + k, mask=k_ok, other=0.0).to(tl.float32))
        a = a.to(dtype).to(tl.float32)
    else:
        head, d = k // HEAD, k % HEAD
        v = tl.load(x + t * stride_xt + head * stride_xh + d, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(other + t * stride_ot + head * stride_oh + d, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == SIGMOID_GATE:
            a = v * tl.sigmoid(g)
        else:  # BLOCK_K holds whole heads (a multiple of HEAD, and K splits at multiples of BLOCK_K)
            rows = tl.reshape(v, (BLOCK_K // HEAD, HEAD))
            rstd_heads = tl.rsqrt(tl.sum(rows * rows, 1) / HEAD + eps)
            normed = tl.reshape((rows * rstd_heads[:, None]).to(dtype).to(tl.float32), (BLOCK_K,))
            a = tl.load(norm_w + d, mask=k_ok, other=0.0).to(tl.float32) * normed
            if ROUND_PRODUCT:
                a = a.to(dtype).to(tl.float32)
            a = a * g * tl.sigmoid(g)
        a = a.to(dtype).to(tl.float32)
        s = a
    return a, s


@triton.jit
def _row_sums(
    x,
    other,
    norm_w,
    normed_out,
    residual_out,
    w,
    w_scale,
    n,
    n_ok,
    scale_row,
    t,
    k_start,
    k_stop,
    K,
    rstd,
    store_inputs,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_wn,
    stride_sn,
    eps,
    FP8: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HEAD: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    first,
    HAS_FIRST: tl.constexpr,
):
    """Token t's sums over K in [k_start, k_stop) for the weight rows n, float32 [BLOCK_N]. FP8: the rows share
    the weight scales of row `scale_row`. store_inputs (ADD_NORM): also store the residual sum and the normed
    row there. HAS_FIRST: `first` holds the weight tile at k_start, loaded already (`_weight_tile`)."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_loop = k_start
    if HAS_FIRST:
        a = _tile_input(x, other, norm_w, normed_out, residual_out, w_scale, scale_row, t, k_start, K, rstd,
                        store_inputs, stride_xt, stride_xh, stride_ot, stride_oh, stride_sn, eps, FP8, PROLOGUE,
                        HEAD, ROUND_PRODUCT, GROUP, BLOCK_K)  # fmt: skip
        acc += first.to(tl.float32) * a[None, :]
        k_loop += BLOCK_K
    for k0 in range(k_loop, k_stop, BLOCK_K):
        a = _tile_input(x, other, norm_w, normed_out, residual_out, w_scale, scale_row, t, k0, K, rstd,
                        store_inputs, stride_xt, stride_xh, stride_ot, stride_oh, stride_sn, eps, FP8, PROLOGUE,
                        HEAD, ROUND_PRODUCT, GROUP, BLOCK_K)  # fmt: skip
        b = _weight_tile(w, n, n_ok, k0, K, stride_wn, BLOCK_K)
        acc += b.to(tl.float32) * a[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _weight_tile(w, n, n_ok, k0, K, stride_wn, BLOCK_K: tl.constexpr):
    """The weight rows n at columns k0 .. k0 + BLOCK_K (zeros past K and for rows not n_ok)."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        w + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0
    )


@triton.jit
def _tile_input(
    x,
    other,
    norm_w,
    normed_out,
    residual_out,
    w_scale,
    scale_row,
    t,
    k0,
    K,
    rstd,
    store_inputs,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_sn,
    eps,
    FP8: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HEAD: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Token t's input at columns k0 .. k0 + BLOCK_K as the product takes it, float32: after the PROLOGUE (storing
    the residual sum and the normed row where ADD_NORM's store_inputs says), FP8: quantized per group, the weight
    scales folded in."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    a, s = _activation(
        x,
        other,
        norm_w,
        t,
        k,
        k_ok,
        rstd,
        stride_xt,
        stride_xh,
        stride_ot,
        stride_oh,
        eps,
        PROLOGUE,
        HEAD,
        ROUND_PRODUCT,
        BLOCK_K,
    )
    if PROLOGUE == ADD_NORM:  # noqa: SIM102 - a compile-time test, then a run-time one
        if store_inputs:
            tl.store(residual_out + t * K + k, s.to(residual_out.dtype.element_ty), mask=k_ok)
            tl.store(normed_out + t * K + k, a.to(normed_out.dtype.element_ty), mask=k_ok)
    if FP8:  # BLOCK_N divides GROUP: the program's rows share one row of weight scales
        a = quantized_vector(a, BLOCK_K, GROUP)
        a *= tl.load(w_scale + scale_row * stride_sn + k // GROUP, mask=k_ok, other=0.0)
    return a


@triton.jit
def _gemv(
    x,
    other,
    norm_w,
    w,
    w_scale,
    tail,
    bias,
    out,
    partials,
    arrivals,
    normed_out,
    residual_out,
    N,
    N_TAIL,
    K,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_wn,
    stride_sn,
    stride_tn,
    stride_om,
    eps,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HEAD: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TOKENS_FIRST: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """out[t, rows] = a[t] @ w[rows]^T (+ bias) for a block of BLOCK_N rows (program_id(0)) and token t
    (program_id(2); with TOKENS_FIRST the grid is (tokens, blocks of rows, slices of K) instead), a being x
    after the PROLOGUE (`_activation`). Output columns N.. come from `tail`, N_TAIL plain rows beside an FP8 weight
    (the blocks of rows past w's); without a tail, N_TAIL is 0 and no block reaches them.

    With SPLIT_K > 1, program_id(1) (TOKENS_FIRST: 2) takes one slice of K (layers with few output rows need the
    extra programs to keep every SM reading). Each slice stores its float32 sums in `partials`; the last slice to
    arrive at a block of rows adds them up in slice order, so the result does not depend on arrival order, and
    resets the block's counter in `arrivals` for the next call.

    ADD_NORM: every program first sums the squares of the whole row (an RMSNorm needs them all); the programs of
    the first block of rows store the residual sum and the normed row, each its own slice of K."""
    if TOKENS_FIRST:  # the tokens of one block of rows launch side by side (they share its weight in L2)
        t, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row_blocks, tokens = tl.num_programs(1), tl.num_programs(0)
    else:
        pid_n, split, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row_blocks, tokens = tl.num_programs(0), tl.num_programs(2)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole BLOCK_Ks, so FP8 groups stay whole
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    main_blocks = tl.cdiv(N, BLOCK_N)
    n_main = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # PDL 2: the first weight tile is loaded before the wait (no kernel writes weights), so that this program's
    # reads from HBM start while the kernel before drains; rows past N (the tail's programs) load nothing
    first = _weight_tile(w, n_main, n_main < N, k_start, K, stride_wn, BLOCK_K) if PDL == 2 else 0.0
    if PDL:  # wait for the kernel before (pdl.py)
        tl.extra.cuda.gdc_wait()
    rstd = 0.0
    if PROLOGUE == ADD_NORM:
        kk = tl.arange(0, BLOCK_K)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            s = tl.load(x + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
            s += tl.load(other + t * stride_ot + k, mask=k < K, other=0.0).to(tl.float32)
            s = s.to(x.dtype.element_ty).to(tl.float32)
            squares += s * s
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    if pid_n >= main_blocks:  # the plain tail's rows
        n = (pid_n - main_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N_TAIL
        y = _row_sums(
            x,
            other,
            norm_w,
            normed_out,
            residual_out,
            tail,
            w_scale,
            n,
            n_ok,
            0,
            t,
            k_start,
            k_stop,
            K,
            rstd,
            False,
            stride_xt,
            stride_xh,
            stride_ot,
            stride_oh,
            stride_tn,
            stride_sn,
            eps,
            False,
            PROLOGUE,
            HEAD,
            ROUND_PRODUCT,
            GROUP,
            BLOCK_N,
            BLOCK_K,
            0.0,
            False,
        )
        col = N + n
    else:
        n = n_main
        n_ok = n < N
        y = _row_sums(
            x,
            other,
            norm_w,
            normed_out,
            residual_out,
            w,
            w_scale,
            n,
            n_ok,
            pid_n * BLOCK_N // GROUP,
            t,
            k_start,
            k_stop,
            K,
            rstd,
            pid_n == 0,
            stride_xt,
            stride_xh,
            stride_ot,
            stride_oh,
            stride_wn,
            stride_sn,
            eps,
            FP8,
            PROLOGUE,
            HEAD,
            ROUND_PRODUCT,
            GROUP,
            BLOCK_N,
            BLOCK_K,
            first,
            PDL == 2,
        )
        col = n
    width = N + N_TAIL
    if SPLIT_K == 1:
        _store_row(y, bias, out + t * stride_om, col, n_ok, HAS_BIAS)
    else:
        counter = arrivals + t * row_blocks + pid_n
        tl.store(partials + (split * tokens + t) * width + col, y, mask=n_ok)
        tl.debug_barrier()  # every thread's sums are stored before the arrival is counted
        if tl.atomic_add(counter, 1) == SPLIT_K - 1:  # acq_rel: the other slices' sums are visible
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                y += tl.load(partials + (s * tokens + t) * width + col, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)
            _store_row(y, bias, out + t * stride_om, col, n_ok, HAS_BIAS)


@triton.jit
def _store_row(y, bias, out_row, n, n_ok, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_row + n, y.to(out_row.dtype.element_ty), mask=n_ok)


class GemvConfig(NamedTuple):
    block_n: int  # divides BLOCK, so a program's rows share one row of weight scales
    block_k: int  # a multiple of BLOCK
    split_k: int  # slices of K, each its own program
    num_warps: int
    tokens_first: bool = False  # launch order: every token of a block of rows, then the next block (under study)


# BLOCK_N rows by BLOCK_K columns per program: its float32 sums are 64 registers per thread at 4 warps.
GEMV_TILE = (16, 512)
# K is split until a layer has this many programs per SM (or a slice would be under two BLOCK_Ks).
GEMV_PROGRAMS_PER_SM = 2
ARRIVAL_COUNTERS = 4096  # blocks of rows times tokens a split call may have
# A weight this small stays in the L2 cache while a step's few tokens read it one program per token, so up to
# SMALL_WEIGHT_MAX_TOKENS tokens the GEMV reads it from HBM about once, in one launch where cuBLAS takes one or two
# (and a fused op's norm or gate one more): the MoE router, GDN's b|a gates in verify steps (K+1 rows a request)
# and decode batches of 2-4 (bench/RESULTS.md, "Linear layers" and "Small weights through the GEMV"). Read at each
# call; 0: off.
SMALL_WEIGHT_BYTES = 4 << 20
SMALL_WEIGHT_MAX_TOKENS = 4


def weight_bytes(w) -> int:
    weight = w.weight if isinstance(w, Fp8Weight) else w
    return weight.numel() * weight.element_size()


def small_weight_gemv(tokens: int, w) -> bool:
    """Whether `tokens` tokens of a projection by `w` (an Fp8Weight or a plain weight) run the GEMV because the
    weight is small enough to be read from the L2 cache by every token after the first."""
    return 0 < tokens <= SMALL_WEIGHT_MAX_TOKENS and weight_bytes(w) <= SMALL_WEIGHT_BYTES


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


class Prologue(NamedTuple):
    """What the GEMV computes from x before the product (`_activation`): `kind` (SIGMOID_GATE, GATED_NORM,
    ADD_NORM), `other` (the gate, z or the residual: x's shape), the norm's weight and eps; ADD_NORM stores the
    residual sum and the normed rows [T, K] in `residual` and `normed`."""

    kind: int
    other: torch.Tensor
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    normed: torch.Tensor | None = None
    residual: torch.Tensor | None = None


def gemv(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    tail: torch.Tensor | None = None,
    prologue: Prologue | None = None,
) -> torch.Tensor:
    """`_gemv` for an Fp8Weight or a plain weight [N, K] (rows contiguous); x [T, K] (rows contiguous), any T;
    with a SIGMOID_GATE or GATED_NORM prologue, x and its `other` are [T, heads, head dim] (last dim contiguous).
    `tail`: plain rows [N_TAIL, K] computed in the same launch, output columns N.. (no bias then)."""
    fp8 = isinstance(w, Fp8Weight)
    weight, scale = (w.weight, w.scale) if fp8 else (w, w)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    n_tail = 0 if tail is None else tail.shape[0]
    config = config or gemv_config(m, n + n_tail, k, x.device)
    assert BLOCK % config.block_n == 0 and config.block_k % BLOCK == 0 and weight.stride(1) == 1
    assert x.stride(-1) == 1 and (tail is None or (bias is None and tail.stride(1) == 1 and tail.shape[1] == k))
    blocks = triton.cdiv(n, config.block_n) + triton.cdiv(n_tail, config.block_n)
    assert config.split_k == 1 or blocks * m <= ARRIVAL_COUNTERS
    out = torch.empty(m, n + n_tail, dtype=x.dtype, device=x.device)
    if m == 0:  # a data-parallel rank without tokens
        return out
    kind, other, norm_weight, eps, head = PLAIN, x, x, 0.0, 1
    if prologue is not None:
        kind, other, eps = prologue.kind, prologue.other, prologue.eps
        norm_weight = x if prologue.norm_weight is None else prologue.norm_weight
        assert other.shape == x.shape and other.stride(-1) == 1
        if kind in (SIGMOID_GATE, GATED_NORM):
            head = x.shape[-1]
            assert x.dim() == 3 and head & (head - 1) == 0 and config.block_k % head == 0
    add_norm = prologue if prologue is not None and kind == ADD_NORM else None  # (kind is PLAIN without one)
    normed = add_norm.normed if add_norm is not None else out
    residual = add_norm.residual if add_norm is not None else out
    split = config.split_k > 1
    partials = torch.empty(config.split_k, m, n + n_tail, dtype=torch.float32, device=x.device) if split else out
    arrivals = _arrivals(x.device) if split else out
    grid = (m, blocks, config.split_k) if config.tokens_first else (blocks, config.split_k, m)
    _gemv[grid](
        x,
        other,
        norm_weight,
        weight,
        scale,
        tail if tail is not None else weight,
        bias if bias is not None else out,
        out,
        partials,
        arrivals,
        normed,
        residual,
        n,
        n_tail,
        k,
        x.stride(0),
        x.stride(1) if x.dim() == 3 else 0,
        other.stride(0),
        other.stride(1) if other.dim() == 3 else 0,
        weight.stride(0),
        scale.stride(0),
        tail.stride(0) if tail is not None else 0,
        out.stride(0),
        eps,
        fp8,
        bias is not None,
        kind.value,
        head,
        norm_weight.dtype == x.dtype,
        BLOCK,
        config.block_n,
        config.block_k,
        config.split_k,
        config.tokens_first,
        num_warps=config.num_warps,
        **pdl.kwargs(x.device),
    )
    return out

"""The kernel of the GEMV (triton_gemv.py launches it): linear layers at a few tokens, for plain and block-scaled
FP8 weights (kernels/fp8.py says what FP8 computes), with a prologue computed on the input as it is loaded and
plain rows beside an FP8 weight; split-K over programs for narrow layers. Its helpers quantize activations for the
MoE kernels too (`quantized_rows`, `quantized_vector`)."""

from __future__ import annotations

import triton
import triton.language as tl

from deltamesh.kernels.triton_pdl import pdl_wait


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
    PDL: tl.constexpr = 0,
):
    """out[t, rows] = a[t] @ w[rows]^T (+ bias) for a block of BLOCK_N rows (program_id(0)) and token t
    (program_id(2)), a being x after the PROLOGUE (`_activation`). Output columns N.. come from `tail`, N_TAIL plain rows beside an FP8 weight
    (the blocks of rows past w's); without a tail, N_TAIL is 0 and no block reaches them.

    With SPLIT_K > 1, program_id(1) takes one slice of K (layers with few output rows need the
    extra programs to keep every SM reading). Each slice stores its float32 sums in `partials`; the last slice to
    arrive at a block of rows adds them up in slice order, so the result does not depend on arrival order, and
    resets the block's counter in `arrivals` for the next call.

    ADD_NORM: every program first sums the squares of the whole row (an RMSNorm needs them all); the programs of
    the first block of rows store the residual sum and the normed row, each its own slice of K."""
    pid_n, split, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_blocks, tokens = tl.num_programs(0), tl.num_programs(2)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole BLOCK_Ks, so FP8 groups stay whole
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    main_blocks = tl.cdiv(N, BLOCK_N)
    n_main = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # PDL 2 and 3: the first weight tile is loaded before the wait (no kernel writes weights), so that this program's
    # reads from HBM start while the kernel before drains; rows past N (the tail's programs) load nothing
    first = _weight_tile(w, n_main, n_main < N, k_start, K, stride_wn, BLOCK_K) if PDL >= 2 else 0.0
    pdl_wait(PDL)  # after the kernel before (pdl.py)
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
            PDL >= 2,
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

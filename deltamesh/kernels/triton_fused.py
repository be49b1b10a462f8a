"""Fused elementwise and norm kernels (Triton): RMSNorm (plain, with the residual add, gated by silu(z)),
SwiGLU's silu(gate) * up, the attention layer's inputs (q/k norm + RoPE + KV write) and its sigmoid output gate
(the depthwise causal conv1d: triton_conv1d.py).

Each program handles one row (a norm needs the whole row in one block) or one block of channels, in float32,
reading inputs through their strides so views from .chunk()/.split() need no copy. No host synchronisation
and grids fixed by the shapes, so all of them can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from deltamesh.kernels import pdl


@functools.cache
def _kernels():
    # One long function on purpose: the kernels are defined here, on first use, so that importing this module
    # (on CPU, in CI) never imports triton; each kernel inside is short.
    import triton
    import triton.language as tl

    global pdl_wait  # a module global: Triton's interpreter resolves a kernel's callees there
    from deltamesh.kernels.triton_pdl import pdl_wait

    @triton.jit
    def rms_norm(
        x_ptr,
        w_ptr,
        out_ptr,
        heads,
        stride_t,
        stride_h,
        stride_d,
        dim,
        eps,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        # Rows are (t, h) pairs of a [T, H, dim] view; a 2-D input arrives as T = 1.
        row = tl.program_id(0).to(tl.int64)
        t, h = row // heads, row % heads
        d = tl.arange(0, BLOCK)
        mask = d < dim
        x = tl.load(x_ptr + t * stride_t + h * stride_h + d * stride_d, mask=mask, other=0.0)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / dim + eps)
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + d, (x * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def add_rms_norm(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        new_res_ptr,
        stride_x,
        stride_r,
        dim,
        eps,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        mask = d < dim
        x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * stride_r + d, mask=mask, other=0.0).to(tl.float32)
        # Round the sum as the unfused `x + residual` does, and normalise the rounded value.
        s = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * dim + d, s, mask=mask)
        s = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, 0) / dim + eps)
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + d, (s * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_rms_norm(
        x_ptr,
        z_ptr,
        w_ptr,
        out_ptr,
        heads,
        stride_xt,
        stride_xh,
        stride_zt,
        stride_zh,
        dim,
        eps,
        ROUND_PRODUCT: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        # Rows are (t, h) pairs of [T, H, dim] views (last dim contiguous); a 2-D input arrives as H = 1.
        row = tl.program_id(0).to(tl.int64)
        t, h = row // heads, row % heads
        d = tl.arange(0, BLOCK)
        mask = d < dim
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + t * stride_zt + h * stride_zh + d, mask=mask, other=0.0).to(tl.float32)
        # Round as the reference does: normed to the input dtype, and weight * normed too when both share it.
        normed = (x * tl.rsqrt(tl.sum(x * x, 0) / dim + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        weighted = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32) * normed
        if ROUND_PRODUCT:
            weighted = weighted.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = weighted * z * tl.sigmoid(z)
        tl.store(out_ptr + row * dim + d, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_mul(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = i < inter
        gate = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + i, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * inter + i, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def attention_inputs(
        qkv_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_t,
        stride_cos,
        stride_sin,
        stride_kp,
        stride_ks,
        stride_kh,
        heads,
        kv_heads,
        eps,
        HEAD_DIM: tl.constexpr,
        ROT: tl.constexpr,
        PAGE: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        # One program per (token, head): query heads 0..heads-1, then the KV heads.
        t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = ROT // 2
        in_rot = d < ROT
        partner = tl.where(d < half, d + half, d - half)  # rotate-half: dim d pairs with d -/+ ROT/2
        sign = tl.where(d < half, -1.0, 1.0)
        row = qkv_ptr + t * stride_t
        if h < heads:
            src = row + h * 2 * HEAD_DIM
            w_ptr = qw_ptr
        else:
            src = row + (heads + h) * HEAD_DIM  # k of KV head h - heads starts after the 2 * heads q|gate rows
            w_ptr = kw_ptr
        x = tl.load(src + d).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
        # Normalised values are rounded to the model dtype before the rotation, as the unfused path does.
        y = (x * rstd * (1.0 + tl.load(w_ptr + d).to(tl.float32))).to(q_out_ptr.dtype.element_ty).to(tl.float32)
        xp = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
        yp = (xp * rstd * (1.0 + wp)).to(q_out_ptr.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_ptr + t * stride_cos + d, mask=in_rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sin + d, mask=in_rot, other=0.0).to(tl.float32)
        out = tl.where(in_rot, y * c + sign * yp * s, y)
        if h < heads:
            tl.store(q_out_ptr + (t * heads + h) * HEAD_DIM + d, out.to(q_out_ptr.dtype.element_ty))
        else:
            kvh = h - heads
            slot = tl.load(slot_ptr + t)
            dst = (slot // PAGE) * stride_kp + (slot % PAGE) * stride_ks + kvh * stride_kh + d
            tl.store(k_cache_ptr + dst, out.to(k_cache_ptr.dtype.element_ty))
            v = tl.load(row + (2 * heads + kv_heads + kvh) * HEAD_DIM + d)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))

    @triton.jit
    def sigmoid_gate(
        x_ptr, gate_ptr, out_ptr, heads, stride_gt, stride_gh, HEAD_DIM: tl.constexpr, PDL: tl.constexpr = 0
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        row = tl.program_id(0).to(tl.int64)
        t, h = row // heads, row % heads
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(x_ptr + row * HEAD_DIM + d).to(tl.float32)
        g = tl.load(gate_ptr + t * stride_gt + h * stride_gh + d).to(tl.float32)
        tl.store(out_ptr + row * HEAD_DIM + d, (x * tl.sigmoid(g)).to(out_ptr.dtype.element_ty))

    return SimpleNamespace(
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        gated_rms_norm=gated_rms_norm,
        silu_mul=silu_mul,
        attention_inputs=attention_inputs,
        sigmoid_gate=sigmoid_gate,
    )


def _row_block(dim: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for a kernel that holds a whole row of `dim` in one block."""
    block = 1 << (dim - 1).bit_length()
    return block, min(max(block // 256, 1), 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x / rms(x) * (1 + weight). x: [rows, dim] or [T, H, dim], any
    strides (e.g. a per-head q/k view); returns a contiguous tensor of x's shape and dtype."""
    kernel = _kernels().rms_norm
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block, warps = _row_block(x.shape[-1])
    rows = x3.shape[0] * x3.shape[1]
    kernel[(rows,)](
        x3,
        weight,
        out,
        x3.shape[1],
        *x3.stride(),
        x.shape[-1],
        eps,
        BLOCK=block,
        num_warps=warps,
        **pdl.kwargs(x.device),
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual) in one pass. x, residual: [T, hidden], last dim contiguous.
    The sum takes the dtype torch's `x + residual` would; the normed output takes the sum's dtype."""
    kernel = _kernels().add_rms_norm
    dtype = torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    new_residual = torch.empty_like(out)
    block, warps = _row_block(x.shape[-1])
    kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        residual.stride(0),
        x.shape[-1],
        eps,
        BLOCK=block,
        num_warps=warps,
        **pdl.kwargs(x.device),
    )
    return out, new_residual


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: weight * x / rms(x) * silu(z). x, z: [rows, dim] or [T, H, dim] of the same shape,
    last dim contiguous, other dims any stride (z is a view into the input projection); returns a contiguous
    tensor of x's shape and dtype."""
    kernel = _kernels().gated_rms_norm
    x3, z3 = (x, z) if x.dim() == 3 else (x.unsqueeze(1), z.unsqueeze(1))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block, warps = _row_block(x.shape[-1])
    kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        z3,
        weight,
        out,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        z3.stride(0),
        z3.stride(1),
        x.shape[-1],
        eps,
        ROUND_PRODUCT=weight.dtype == x.dtype,
        BLOCK=block,
        num_warps=warps,
        **pdl.kwargs(x.device),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: [T, 2I] (gate | up, last dim contiguous) -> silu(gate) * up, [T, I]."""
    kernel = _kernels().silu_mul
    inter = gate_up.shape[-1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    kernel[(gate_up.shape[0], -(-inter // block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, **pdl.kwargs(gate_up.device)
    )
    return out


def attention_inputs(qkv, heads, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """deltamesh.kernels.torch_ref.attention_inputs in one kernel: q/k RMSNorm, RoPE, the KV write; returns q [T, H, D].
    Needs a power-of-two head dim; qkv's last dim contiguous, k_cache / v_cache with the same strides."""
    kernel = _kernels().attention_inputs
    t, dim, kv_heads = qkv.shape[0], k_cache.shape[-1], k_cache.shape[-2]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and qkv.stride(-1) == 1
    q = torch.empty((t, heads, dim), dtype=qkv.dtype, device=qkv.device)
    kernel[(t, heads + kv_heads)](
        qkv,
        q_weight,
        k_weight,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        heads,
        kv_heads,
        eps,
        HEAD_DIM=dim,
        ROT=cos.shape[-1],
        PAGE=k_cache.shape[1],
        num_warps=2,
        **pdl.kwargs(qkv.device),
    )
    return q


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) -> [T, H*D]; x [T, H, D] contiguous, gate a [T, H, D] view (last dim contiguous);
    power-of-two D."""
    kernel = _kernels().sigmoid_gate
    t, heads, dim = x.shape
    out = torch.empty((t, heads * dim), dtype=x.dtype, device=x.device)
    kernel[(t * heads,)](
        x, gate, out, heads, gate.stride(0), gate.stride(1), HEAD_DIM=dim, num_warps=2, **pdl.kwargs(x.device)
    )
    return out

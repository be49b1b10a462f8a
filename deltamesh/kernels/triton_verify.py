"""Speculative verification of GDN layers on CUDA (Triton): each sequence's W tokens (its last token and its
drafts) run in one program from its pooled state, and the state after every token is written to the draft pool,
the pooled state left as it was (torch_ref.gdn_verify / conv1d_verify are the reference). Neither FlashInfer's
decode kernels nor FLA's fused recurrent kernel write a state per token into a pool by index (FLA returns the final
state only; FlashInfer's `gated_delta_rule_mtp` keeps intermediate states in a buffer of its own layout, bf16-state
path only), so these keep the engine's pool layout and both state dtypes.

`gdn_verify`: one program per (sequence, value head, block of value rows) holds that block of the state,
[BLOCK_V, K] in float32, across the W tokens; q and k are L2-normalised and the gates activated in the kernel.
Between tokens the state is rounded to the draft pool's dtype, as decoding one token at a time rounds it to the
pool's. `conv1d_verify`: one program per (sequence, block of channels) walks the W tokens through the window.
"""

from __future__ import annotations

import functools

import torch

from deltamesh.kernels import pdl


@functools.cache
def _kernels():
    # defined on first use, so that importing this module (on CPU, in CI) never imports triton
    import triton
    import triton.language as tl

    global pdl_wait  # a module global: Triton's interpreter resolves a kernel's callees there
    from deltamesh.kernels.triton_pdl import pdl_wait

    @triton.jit
    def gdn_verify(
        q_ptr,
        k_ptr,
        v_ptr,
        a_ptr,
        b_ptr,
        a_log_ptr,
        dt_bias_ptr,
        pool_ptr,
        idx_ptr,
        draft_ptr,
        draft_idx_ptr,
        out_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_at,
        stride_bt,
        stride_pp,
        stride_ph,
        stride_dp,
        stride_dh,
        value_dim,
        GROUP: tl.constexpr,  # value heads per key head
        W: tl.constexpr,
        KEY_DIM: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        n, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = hv // GROUP
        kk = tl.arange(0, BLOCK_K)
        vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        kmask, vmask = kk < KEY_DIM, vv < value_dim
        tile = vv[:, None] * KEY_DIM + kk[None, :]
        tmask = vmask[:, None] & kmask[None, :]
        src = pool_ptr + tl.load(idx_ptr + n).to(tl.int64) * stride_pp + hv * stride_ph
        h = tl.load(src + tile, mask=tmask, other=0.0).to(tl.float32)
        a_log = tl.load(a_log_ptr + hv).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        for j in tl.static_range(W):
            t = (n * W + j).to(tl.int64)
            q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + kk, mask=kmask, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + kk, mask=kmask, other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q) + 1e-6)) * (1.0 / tl.sqrt(KEY_DIM * 1.0))
            k = k * (1.0 / tl.sqrt(tl.sum(k * k) + 1e-6))
            v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + vv, mask=vmask, other=0.0).to(tl.float32)
            x = tl.load(a_ptr + t * stride_at + hv).to(tl.float32) + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            decay = tl.exp(-tl.exp(a_log) * softplus)
            beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + t * stride_bt + hv).to(tl.float32)))
            h = h * decay
            delta = (v - tl.sum(h * k[None, :], axis=1)) * beta
            h = h + delta[:, None] * k[None, :]
            o = tl.sum(h * q[None, :], axis=1)
            tl.store(
                out_ptr + (t * tl.num_programs(1) + hv) * value_dim + vv, o.to(out_ptr.dtype.element_ty), mask=vmask
            )
            dst = draft_ptr + tl.load(draft_idx_ptr + t).to(tl.int64) * stride_dp + hv * stride_dh
            kept = h.to(draft_ptr.dtype.element_ty)
            tl.store(dst + tile, kept, mask=tmask)
            h = kept.to(tl.float32)

    @triton.jit
    def conv1d_verify(
        x_ptr,
        pool_ptr,
        idx_ptr,
        draft_ptr,
        draft_idx_ptr,
        w_ptr,
        out_ptr,
        stride_x,
        stride_pp,
        stride_pc,
        stride_dp,
        stride_dc,
        stride_wc,
        channels,
        W: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        n = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < channels
        state = pool_ptr + tl.load(idx_ptr + n).to(tl.int64) * stride_pp + c * stride_pc
        # the kernel's window of 4: the three kept inputs (oldest first), then each token in turn
        s0 = tl.load(state, mask=mask, other=0.0)
        s1 = tl.load(state + 1, mask=mask, other=0.0)
        s2 = tl.load(state + 2, mask=mask, other=0.0)
        w0 = tl.load(w_ptr + c * stride_wc, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + c * stride_wc + 1, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + c * stride_wc + 2, mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + c * stride_wc + 3, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(W):
            t = (n * W + j).to(tl.int64)
            x = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0).to(pool_ptr.dtype.element_ty)
            acc = s0.to(tl.float32) * w0 + s1.to(tl.float32) * w1 + s2.to(tl.float32) * w2 + x.to(tl.float32) * w3
            s0, s1, s2 = s1, s2, x
            dst = draft_ptr + tl.load(draft_idx_ptr + t).to(tl.int64) * stride_dp + c * stride_dc
            tl.store(dst, s0.to(draft_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + 1, s1.to(draft_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + 2, s2.to(draft_ptr.dtype.element_ty), mask=mask)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + t * channels + c, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return gdn_verify, conv1d_verify


def gdn_verify(q, k, v, a, b, A_log, dt_bias, state_pool, state_idx, draft_pool, draft_idx) -> torch.Tensor:
    """torch_ref.gdn_verify's contract: q, k [N*W, HK, K], v [N*W, HV, V] (last dims contiguous), a, b [N*W, HV],
    pools [P, HV, V, K] (inner dims contiguous), state_idx [N], draft_idx [N, W]."""
    kernel = _kernels()[0]
    n, w = draft_idx.shape
    hk, key_dim = q.shape[1], q.shape[2]
    hv, value_dim = v.shape[1], v.shape[2]
    assert state_pool.stride(-1) == 1 and state_pool.stride(-2) == key_dim and draft_pool.stride(-2) == key_dim
    out = torch.empty((n * w, hv, value_dim), dtype=v.dtype, device=v.device)
    block_k = max(16, 1 << (key_dim - 1).bit_length())
    block_v = min(32, max(16, 1 << (value_dim - 1).bit_length()))
    draft_rows, state_idx = draft_idx.reshape(-1).contiguous(), state_idx.contiguous()
    kernel[(n, hv, -(-value_dim // block_v))](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        state_pool,
        state_idx,
        draft_pool,
        draft_rows,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        b.stride(0),
        state_pool.stride(0),
        state_pool.stride(1),
        draft_pool.stride(0),
        draft_pool.stride(1),
        value_dim,
        GROUP=hv // hk,
        W=w,
        KEY_DIM=key_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        **pdl.kwargs(v.device),
    )
    return out


def conv1d_verify(x, conv_pool, state_idx, draft_pool, draft_idx, weight, activation="silu") -> torch.Tensor:
    """torch_ref.conv1d_verify's contract, for a kernel of width 4 (the models'): x [N*W, C] (last dim
    contiguous), pools [P, C, 3] (last dim contiguous)."""
    assert weight.shape[-1] == 4, "the verify kernel's window is 4 wide"
    kernel = _kernels()[1]
    n, w = draft_idx.shape
    channels = x.shape[1]
    out = torch.empty((n * w, channels), dtype=x.dtype, device=x.device)
    block = 256
    kernel[(n, -(-channels // block))](
        x,
        conv_pool,
        state_idx.contiguous(),
        draft_pool,
        draft_idx.reshape(-1).contiguous(),
        weight,
        out,
        x.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        draft_pool.stride(0),
        draft_pool.stride(1),
        weight.stride(0),
        channels,
        W=w,
        SILU=activation in ("silu", "swish"),
        BLOCK=block,
        **pdl.kwargs(x.device),
    )
    return out

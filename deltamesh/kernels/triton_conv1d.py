"""The depthwise causal conv1d of the GDN layers (Triton): its decode step (`conv1d_update`: one token per sequence,
shifting it into the pooled state) and its prefill over variable-length sequences (`conv1d_prefill`), in float32,
reading inputs through their strides. No host synchronisation and grids fixed by the shapes, so both can be captured
in CUDA graphs. (Speculative verification's conv steps: triton_verify.py.)
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from deltamesh.kernels import pdl


@functools.cache
def _kernels():
    # defined on first use, so that importing this module (on CPU, in CI) never imports triton
    import triton
    import triton.language as tl

    global pdl_wait  # a module global: Triton's interpreter resolves a kernel's callees there
    from deltamesh.kernels.triton_pdl import pdl_wait

    # idx_ptr is a slice of the step's state rows, starting after its decode (or verify) rows: 16-byte aligned or
    # not with their count, which Triton would specialize into a compile per class, met while serving.
    @triton.jit(do_not_specialize_on_alignment=["idx_ptr"])
    def conv1d_update(
        x_ptr,
        pool_ptr,
        idx_ptr,
        w_ptr,
        out_ptr,
        stride_x,
        stride_pp,
        stride_pc,
        stride_wc,
        channels,
        WIDTH: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < channels
        state = pool_ptr + tl.load(idx_ptr + b).to(tl.int64) * stride_pp + c * stride_pc
        # The new input enters the window at the pool's precision, as it will be stored.
        x = tl.load(x_ptr + b.to(tl.int64) * stride_x + c, mask=mask, other=0.0).to(pool_ptr.dtype.element_ty)
        acc = x.to(tl.float32) * tl.load(w_ptr + c * stride_wc + WIDTH - 1, mask=mask, other=0.0).to(tl.float32)
        # Walk the state from its newest slot: each slot is read, then takes the value one place newer.
        newer = x
        for k in tl.static_range(WIDTH - 2, -1, -1):
            s = tl.load(state + k, mask=mask, other=0.0)
            acc += s.to(tl.float32) * tl.load(w_ptr + c * stride_wc + k, mask=mask, other=0.0).to(tl.float32)
            tl.store(state + k, newer, mask=mask)
            newer = s
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + b.to(tl.int64) * channels + c, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize_on_alignment=["idx_ptr"])  # as conv1d_update's
    def conv1d_prefill(
        x_ptr,
        pool_ptr,
        idx_ptr,
        w_ptr,
        out_ptr,
        cu_ptr,
        stride_x,
        stride_pp,
        stride_pc,
        stride_wc,
        channels,
        WIDTH: tl.constexpr,
        HIST_P2: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        # One program per (sequence, tile of tokens, block of channels): a long prompt spreads over the whole GPU.
        # Only a sequence's first tile reaches back into the pooled state (BLOCK_T >= WIDTH - 1), so that program
        # alone writes the new state, after its own reads.
        s, tile = tl.program_id(0), tl.program_id(1)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < channels
        start = tl.load(cu_ptr + s).to(tl.int64)
        length = tl.load(cu_ptr + s + 1).to(tl.int64) - start
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        if tile * BLOCK_T < length:
            state = pool_ptr + tl.load(idx_ptr + s).to(tl.int64) * stride_pp + c[None, :] * stride_pc
            x_seq = x_ptr + start * stride_x + c[None, :]
            ok = c_ok[None, :] & (rows[:, None] < length)
            acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
            for k in tl.static_range(WIDTH):
                src = rows[:, None] - (WIDTH - 1) + k  # input position; negative: the pooled history
                v = tl.load(x_seq + src * stride_x, mask=ok & (src >= 0), other=0.0)
                v += tl.load(state + (WIDTH - 1) + src, mask=ok & (src < 0), other=0.0).to(v.dtype)
                acc += (
                    v.to(tl.float32) * tl.load(w_ptr + c * stride_wc + k, mask=c_ok, other=0.0).to(tl.float32)[None, :]
                )
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(
                out_ptr + (start + rows[:, None]) * channels + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok
            )
            if tile == 0:
                # The new state: the last WIDTH - 1 inputs, older ones from the old state when the sequence is short.
                j = tl.arange(0, HIST_P2)[:, None]
                last = length - (WIDTH - 1) + j  # input position of each kept value
                keep = c_ok[None, :] & (j < WIDTH - 1)
                new = tl.load(x_seq + last * stride_x, mask=keep & (last >= 0), other=0.0)
                new += tl.load(state + (WIDTH - 1) + last, mask=keep & (last < 0), other=0.0).to(new.dtype)
                tl.debug_barrier()  # every lane has read the old state before any lane overwrites it
                tl.store(state + j, new.to(pool_ptr.dtype.element_ty), mask=keep)

    return SimpleNamespace(conv1d_update=conv1d_update, conv1d_prefill=conv1d_prefill)


def conv1d_update(
    x: torch.Tensor,  # [B, C], last dim contiguous
    conv_pool: torch.Tensor,  # [P, C, W-1], last dim contiguous
    state_idx: torch.Tensor,  # [B] int32 or int64
    weight: torch.Tensor,  # [C, W], last dim contiguous
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of the depthwise causal conv (torch_ref.conv1d_update): shifts x into each
    sequence's pooled state in place and returns act(window . weight), [B, C] in x's dtype."""
    kernel = _kernels().conv1d_update
    batch, channels = x.shape
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    block = 256
    kernel[(batch, -(-channels // block))](
        x,
        conv_pool,
        state_idx,
        weight,
        out,
        x.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        weight.stride(0),
        channels,
        WIDTH=weight.shape[-1],
        SILU=activation in ("silu", "swish"),
        BLOCK=block,
        **pdl.kwargs(x.device),
    )
    return out


def conv1d_prefill(
    x: torch.Tensor,  # [T, C], last dim contiguous
    seq_lens: list[int],
    cu_seqlens: torch.Tensor,  # [N+1] int32/int64 offsets of the sequences in x, on x's device
    conv_pool: torch.Tensor,  # [P, C, W-1], last dim contiguous
    state_idx: torch.Tensor,  # [N]
    weight: torch.Tensor,  # [C, W], last dim contiguous
    activation: str | None = "silu",
) -> torch.Tensor:
    """deltamesh.kernels.torch_ref.conv1d_prefill in one kernel: the causal conv over variable-length sequences, each
    continuing from its pooled state, which it then replaces with the sequence's last W-1 inputs. The offsets come
    on the device (the step's own): building them here from `seq_lens` would wait for the GPU."""
    import triton

    kernel = _kernels().conv1d_prefill
    channels, width = weight.shape
    out = torch.empty((x.shape[0], channels), dtype=x.dtype, device=x.device)
    block_t, block_c = 64, 64
    kernel[(len(seq_lens), -(-max(seq_lens) // block_t), -(-channels // block_c))](
        x,
        conv_pool,
        state_idx,
        weight,
        out,
        cu_seqlens,
        x.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        weight.stride(0),
        channels,
        WIDTH=width,
        HIST_P2=triton.next_power_of_2(width - 1),
        SILU=activation in ("silu", "swish"),
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        **pdl.kwargs(x.device),
    )
    return out

"""Paged attention for CUDA GPUs: a Triton split-KV decode kernel that reads the page-major KV pool in
place (GQA: each program serves one KV head's whole query group), and prefill through PyTorch's fused
SDPA over each sequence's gathered pages (bottom-right causal mask for chunks that continue a prefix).

The decode kernel streams BLOCK_N tokens (several pages, gathered row by row through the block table)
per loop trip, so enough KV bytes are in flight to keep HBM busy; the number of splits per sequence is
chosen from the batch size so the grid covers the GPU several times over at any batch. It has no host
synchronisation and a grid fixed by (batch, kv heads, splits), so a decode step can be captured in a
CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltamesh.kernels import pdl
from deltamesh.kernels.batch import StepBatch


@dataclass(frozen=True)
class DecodeLaunch:
    """Tile and grid of the decode kernel (bench/gpu_kernels.py --attention sweeps these)."""

    # Defaults: the best of that sweep on the 9B attention shape at batch 64 and 256 (bench/RESULTS.md).
    block_n: int = 32  # tokens per loop trip
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 2048  # splits are chosen so batch * kv_heads * splits reaches about this
    max_splits: int = 32

    def splits(self, batch: int, kv_heads: int) -> int:
        want = -(-self.target_programs // (batch * kv_heads))
        return min(self.max_splits, triton_next_pow2(max(1, want)))


DEFAULT_LAUNCH = DecodeLaunch()


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernels():
    # defined on first use, so that importing this module (on CPU, in CI) never imports triton
    import triton
    import triton.language as tl

    global pdl_wait  # a module global: Triton's interpreter resolves a kernel's callees there
    from deltamesh.kernels.triton_pdl import pdl_wait

    # The block table's width is the step's longest sequence in pages: any integer, which Triton would specialize
    # (1, a multiple of 16, other) into three compiles met while serving.
    @triton.jit(do_not_specialize=["stride_tb"], do_not_specialize_on_alignment=["stride_tb"])
    def decode_split(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        seq_lens_ptr,
        part_out_ptr,
        part_lse_ptr,
        stride_qt,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        scale,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        n_blocks = tl.cdiv(seq_len, BLOCK_N)
        per_split = tl.cdiv(n_blocks, SPLITS)
        first, last = split * per_split, tl.minimum((split + 1) * per_split, n_blocks)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        q_rows = kvh * GROUP + g
        q = tl.load(
            q_ptr + b * stride_qt + q_rows[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for blk in range(first, last):
            tok = blk * BLOCK_N + n
            valid = tok < seq_len
            page = tl.load(tables_ptr + b * stride_tb + tok // PAGE, mask=valid, other=0).to(tl.int64)
            rows = page * stride_kp + (tok % PAGE) * stride_ks + kvh * stride_kh
            offs = rows[:, None] + d[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [GROUP_PAD, BLOCK_N]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            probs = tl.exp(scores - m_new[:, None])
            l = l * alpha + tl.sum(probs, 1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v).to(tl.float32)
            m = m_new
        out_offs = b * stride_ob + q_rows[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(part_out_ptr + out_offs, acc / tl.where(l > 0, l, 1.0)[:, None], mask=(g < GROUP)[:, None])
        lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + b * stride_lb + q_rows * stride_lh + split, lse, mask=g < GROUP)

    @triton.jit
    def merge_splits(
        part_out_ptr,
        part_lse_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        stride_t,
        stride_h,
        HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        b, h = tl.program_id(0), tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, HEAD_DIM)
        base = b * stride_ob + h * stride_oh
        lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + sp)
        weights = tl.exp(lse - tl.max(lse, 0))  # an empty split has lse -inf: weight 0
        weights = weights / tl.sum(weights, 0)
        parts = tl.load(part_out_ptr + base + sp[:, None] * stride_os + d[None, :])
        out = tl.sum(parts * weights[:, None], 0)
        tl.store(out_ptr + b * stride_t + h * stride_h + d, out.to(out_ptr.dtype.element_ty))

    return decode_split, merge_splits


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [P, page_size, Hkv, D] (strided on P)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32, including the new token
    scale: float,
    launch: DecodeLaunch = DEFAULT_LAUNCH,
) -> torch.Tensor:
    decode_split, merge_splits = _kernels()
    batch, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and k_cache.stride(2) == dim
    splits = launch.splits(batch, kv_heads)
    part_out = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    decode_split[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        scale,
        GROUP=group,
        GROUP_PAD=max(16, triton_next_pow2(group)),
        HEAD_DIM=dim,
        PAGE=page,
        BLOCK_N=launch.block_n,
        SPLITS=splits,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **pdl.kwargs(q.device),
    )
    out = torch.empty_like(q)
    merge_splits[(batch, heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=dim,
        SPLITS=splits,
        **pdl.kwargs(q.device),
    )
    return out


def _prefill(q, k_cache, v_cache, batch: StepBatch, scale: float) -> torch.Tensor:
    """Each prefill chunk attends over its gathered context with the fused SDPA kernels."""
    from torch.nn.attention.bias import causal_lower_right

    outs, start = [], 0
    page = k_cache.shape[1]
    groups = q.shape[1] // k_cache.shape[2]
    for i in range(batch.num_decode, batch.num_seqs):
        n, ctx = batch.query_lens[i], batch.context_lens[i]
        kv_len = ctx + n
        pages = batch.block_tables[i, : -(-kv_len // page)].long()
        k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(groups, 1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(groups, 1)
        qi = q[start : start + n].transpose(0, 1)[None]
        mask = causal_lower_right(n, kv_len) if ctx else None
        o = F.scaled_dot_product_attention(
            qi, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None, scale=scale
        )
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def paged_attention(q, k_cache, v_cache, batch: StepBatch, scale: float) -> torch.Tensor:
    nd = batch.num_decode
    parts = []
    if nd:
        parts.append(paged_decode(q[:nd], k_cache, v_cache, batch.block_tables[:nd], batch.seq_lens[:nd], scale))
    if batch.num_seqs > nd:
        parts.append(_prefill(q[nd:], k_cache, v_cache, batch, scale))
    return torch.cat(parts) if len(parts) > 1 else parts[0]

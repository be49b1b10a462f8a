"""A request's state in the one-rank layout, and the part of it each tensor-parallel rank holds.

State leaves a worker and arrives in the layout a one-rank engine holds it in (engine/cache.py), whatever the
ranks on either side: a tensor-parallel prefill worker's leader merges its ranks' parts of a finished prefill
(`merge`), a tensor-parallel decode worker's leader splits an arrived state into its ranks' parts (`split`).
So any two layouts that each split the model can hand state to each other, and exactly: only copies.

What rank r of N holds (engine/parallel.py, Shard):
- KV pages [page, layer, k|v, slot, head, dim]: the KV heads `Shard.kv_heads()`. With more ranks than KV heads
  one head is on several ranks (replicated, the same bytes); merging takes each head once.
- conv state [layer, channel, W-1]: the channels are q | k | v concatenated, each split by head, so rank r holds
  q_r | k_r | v_r (as the conv1d weight is split), not the r-th chunk of the concatenation.
- recurrent state [layer, value head, V, K]: the r-th chunk of the value heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.parallel import Shard


@dataclass(frozen=True)
class RequestState:
    """One request's state, in one rank's layout or the one-rank layout."""

    kv: torch.Tensor  # [pages, layers, 2, page_size, kv_heads, head_dim]
    conv: torch.Tensor  # [layers, conv channels, W-1]
    recurrent: torch.Tensor  # [layers, value heads, V, K]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv, self.conv, self.recurrent


KV_HEAD_DIM, CONV_CHANNEL_DIM, RECURRENT_HEAD_DIM = 4, 1, 1


def _qkv_sizes(full: ModelConfig, size: int) -> tuple[int, int, int]:
    """Conv channels of q, k and v on each of `size` ranks."""
    return full.linear_key_dim // size, full.linear_key_dim // size, full.linear_value_dim // size


def split(state: RequestState, shard: Shard) -> RequestState:
    """Rank `shard.rank`'s part of a one-rank state."""
    n, r = shard.size, shard.rank
    if n == 1:
        return state
    first, count = shard.kv_heads()
    q, k, v = state.conv.split(_qkv_sizes(shard.full, 1), CONV_CHANNEL_DIM)
    conv = torch.cat([part.chunk(n, CONV_CHANNEL_DIM)[r] for part in (q, k, v)], CONV_CHANNEL_DIM)
    return RequestState(
        state.kv.narrow(KV_HEAD_DIM, first, count),
        conv,
        state.recurrent.chunk(n, RECURRENT_HEAD_DIM)[r],
    )


def merge(parts: list[RequestState], full: ModelConfig, expert_parallel: bool = False) -> RequestState:
    """The one-rank state of which `parts` are ranks 0..N-1's parts."""
    n = len(parts)
    if n == 1:
        return parts[0]
    heads: dict[int, torch.Tensor] = {}  # first KV head of a rank's part -> that part (replicas taken once)
    for rank, part in enumerate(parts):
        first, _ = Shard(n, rank, full, expert_parallel).kv_heads()
        heads.setdefault(first, part.kv)
    kv = torch.cat([heads[first] for first in sorted(heads)], KV_HEAD_DIM)
    qkv = [part.conv.split(_qkv_sizes(full, n), CONV_CHANNEL_DIM) for part in parts]
    conv = torch.cat([torch.cat([rank[i] for rank in qkv], CONV_CHANNEL_DIM) for i in range(3)], CONV_CHANNEL_DIM)
    recurrent = torch.cat([part.recurrent for part in parts], RECURRENT_HEAD_DIM)
    return RequestState(kv, conv, recurrent)


def part_shapes(full: ModelConfig, like: RequestState, num_pages: int, size: int) -> list[RequestState]:
    """Ranks 0..size-1's parts of a one-rank state of `num_pages` pages, as meta tensors (shapes and dtypes only),
    `like` giving the one-rank layout's per-page KV shape, conv and recurrent shapes and dtypes."""
    meta = torch.device("meta")
    whole = RequestState(
        like.kv.new_empty((num_pages, *like.kv.shape[1:]), device=meta),
        like.conv.new_empty(like.conv.shape, device=meta),
        like.recurrent.new_empty(like.recurrent.shape, device=meta),
    )
    return [split(whole, Shard(size, r, full)) for r in range(size)]


def nbytes(state: RequestState) -> int:
    return sum(t.numel() * t.element_size() for t in state.tensors())


def unpack(flat: torch.Tensor, shapes: list[RequestState]) -> list[RequestState]:
    """The parts laid end to end in `flat` (1-D bytes: each part's kv, conv, recurrent in turn), as tensors of
    `shapes`' shapes and dtypes viewing it."""
    parts, offset = [], 0
    for shape in shapes:
        tensors = []
        for t in shape.tensors():
            n = t.numel() * t.element_size()
            tensors.append(flat[offset : offset + n].view(t.dtype).view(t.shape))
            offset += n
        parts.append(RequestState(*tensors))
    return parts

"""Held and arriving request state of a tensor-parallel engine, in the one-rank layout that travels.

Each rank holds its part of a request's state in its own pools (engine/state_shards.py says which part). What
a prefill worker offers and a decode worker receives is the state in the layout of a one-rank engine, so a
worker of any layout can pull it. The leader (rank 0) keeps that layout in a small `HandoffArea` of its own
(room for `--handoff-states` states of the longest context, made on first use):

- prefill, in an engine without `rank_exporter` (a prefill worker's transport sets one: then each rank's part
  is offered where it is, engine/held_states.py): when a request's state is held, `gather` takes room in the
  area, brings every rank's part to the leader (torch.distributed gather over the engine's group) and merges
  them there, and the transport offers it; the room is given back when the lease ends. With the area full the
  request waits (engine/held_states.py).
- decode: room for an arriving state is taken in the area when its space is reserved; the transport pulls into
  it; before the request's first step, `scatter` splits the state and sends each rank its part (scatter over
  the group), which each rank writes into its own pools, and the room is given back.

Both run on the leader's stepping thread, which also sends the steps: the followers meet them in the same order
(engine/tp_workers.py), after every step launched before, so the state they read is final and what they write
is in place before the request's first step. The cost is one copy of the state through the leader.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from deltamesh.engine.cache import KVPagePool, PoolExhausted, Region, StatePool, pool_views
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.parallel import Shard, TensorParallelGroup
from deltamesh.engine.state_shards import RequestState, merge, split


def rank_state(kv_pool: KVPagePool, state_pool: StatePool, pages: list[int], slot: int) -> RequestState:
    """A copy of this rank's state of the request in `pages` and `slot`."""
    return RequestState(kv_pool.data[pages], state_pool.conv[slot].clone(), state_pool.recurrent[slot].clone())


def store_rank_state(
    kv_pool: KVPagePool, state_pool: StatePool, pages: list[int], slot: int, state: RequestState
) -> None:
    kv_pool.data[pages] = state.kv
    state_pool.conv[slot].copy_(state.conv)
    state_pool.recurrent[slot].copy_(state.recurrent)


def gather_parts(tp: TensorParallelGroup, mine: RequestState) -> list[RequestState] | None:
    """Every rank calls it with its part; rank 0 gets all ranks' parts, in rank order (the others None)."""
    import torch.distributed as dist

    leader = tp.shard.rank == 0
    lists = [[torch.empty_like(t) for _ in range(tp.shard.size)] if leader else None for t in mine.tensors()]
    for t, out in zip(mine.tensors(), lists):
        dist.gather(t.contiguous(), out, dst=0, group=tp.group)
    return [RequestState(*parts) for parts in zip(*lists)] if leader else None


def scatter_parts(tp: TensorParallelGroup, like: RequestState, parts: list[RequestState] | None) -> RequestState:
    """Every rank calls it (rank 0 with all ranks' parts, the others with None); each gets its own part, shaped
    as `like`."""
    import torch.distributed as dist

    received = [torch.empty_like(t) for t in like.tensors()]
    for i, out in enumerate(received):
        sent = [part.tensors()[i].contiguous() for part in parts] if parts is not None else None
        dist.scatter(out, sent, src=0, group=tp.group)
    return RequestState(*received)


def one_rank_pools(
    full: ModelConfig, like_kv: KVPagePool, like_states: StatePool, num_pages: int, num_slots: int
) -> tuple[KVPagePool, StatePool]:
    """Pools of a one-rank engine of the same model (dtypes, device and page size as `like_kv`, `like_states`)."""
    data, conv, recurrent = like_kv.data, like_states.conv, like_states.recurrent
    kv = KVPagePool(
        num_pages,
        like_kv.page_size,
        like_kv.num_layers,  # the MTP module's too, with speculative decoding
        full.num_key_value_heads,
        full.head_dim,
        data.dtype,
        data.device,
    )
    states = StatePool(
        num_slots,
        len(full.linear_layers),
        full.conv_dim,
        full.linear_conv_kernel_dim,
        full.linear_num_value_heads,
        full.linear_key_head_dim,
        full.linear_value_head_dim,
        conv.dtype,
        recurrent.dtype,
        conv.device,
    )
    return kv, states


def one_rank_template(full: ModelConfig, like_kv: KVPagePool, like_states: StatePool) -> RequestState:
    """One page and one slot of a one-rank engine's state of the model (dtypes and page size as `like_kv`,
    `like_states`), as meta tensors: shapes and dtypes only."""
    meta = torch.device("meta")
    kv, states = one_rank_pools(
        full, KVPagePool.shaped_like(like_kv, 1, meta), StatePool.shaped_like(like_states, 1, meta), 1, 1
    )
    return RequestState(kv.data[:1], states.conv[0], states.recurrent[0])


@dataclass(frozen=True)
class Staged:
    """Where one arriving state waits in an HandoffArea."""

    pages: list[int]
    slot: int


class HandoffArea:
    """Where a parallel worker's states leave from and arrive in: one-rank layout pools with their own
    allocator, room for a few states of the longest context (`AreaSize`). A held state takes room when it is
    held and gives it back when its lease ends; an arriving one when its space is reserved, until its rank or
    ranks took it, before its first step. Far smaller than a copy of the pools, which on a GPU take most of its
    memory."""

    def __init__(self, kv: KVPagePool, states: StatePool):
        self.kv, self.states = kv, states

    def take(self, num_pages: int) -> Staged:
        """Space for a state of `num_pages` pages; PoolExhausted when the area is full."""
        slot = self.states.alloc(zeroed=False)
        try:
            return Staged(self.kv.alloc(num_pages), slot)
        except PoolExhausted:
            self.states.free(slot)
            raise

    def give_back(self, staged: Staged) -> None:
        self.kv.free(staged.pages)
        self.states.free(staged.slot)

    def read(self, staged: Staged) -> RequestState:
        return rank_state(self.kv, self.states, staged.pages, staged.slot)

    def write(self, staged: Staged, state: RequestState) -> None:
        store_rank_state(self.kv, self.states, staged.pages, staged.slot, state)

    def regions(self, staged: Staged) -> list[Region]:
        return self.kv.regions(staged.pages) + self.states.regions(staged.slot)


@dataclass(frozen=True)
class AreaSize:
    """The size of a parallel worker's HandoffArea: room for `states` states and `pages` pages in all."""

    states: int
    pages: int

    @classmethod
    def of(cls, states: int, max_model_len: int, kv: KVPagePool, slots: StatePool) -> AreaSize:
        """`states` states of the longest context, but no more than the pools could take at once."""
        return cls(min(states, slots.num_slots), min(states * kv.pages_for(max_model_len), kv.num_pages))


class Handoff(ABC):
    """What both parallel hand-offs share: the hand-off area, made on first use."""

    def __init__(self, followers, kv_pool: KVPagePool, state_pool: StatePool, size: AreaSize):
        self.followers, self.kv_pool, self.state_pool, self.size = followers, kv_pool, state_pool, size
        self._area: HandoffArea | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def gather(self, pages: list[int], slot: int, rank: int = 0) -> Staged:
        """A held request's state (in `pages` and `slot` of rank `rank`'s pools), into room taken in the area
        (stepping thread); PoolExhausted, before anything moves, when the area is full."""

    @abstractmethod
    def scatter(self, pages: list[int], slot: int, rank: int, staged: Staged) -> None:
        """An arrived state, from the area into the pools of the rank or ranks that run it (stepping thread)."""

    def takes_parts(self, size: int) -> bool:
        """Whether a state sent as `size` tensor-parallel ranks' parts goes to this engine's ranks as it is
        (`hand_out`), without the area: when they are its own ranks' parts."""
        return False

    def hand_out(self, pages: list[int], slot: int, parts: list[RequestState]) -> None:
        """Each rank its part of an arrived state, as it came (only where `takes_parts`)."""
        raise NotImplementedError(f"{type(self).__name__} takes no rank parts")

    @abstractmethod
    def _make_area(self) -> HandoffArea:
        """The area, in the one-rank layout of this engine's model (made on first use)."""

    @property
    def area(self) -> HandoffArea:
        with self._lock:
            if self._area is None:
                self._area = self._make_area()
            return self._area

    def stage(self, num_pages: int) -> Staged:
        """Room for a state of `num_pages` pages (any thread); PoolExhausted when there is none."""
        return self.area.take(num_pages)

    def unstage(self, staged: Staged) -> None:
        self.area.give_back(staged)

    def staged_regions(self, staged: Staged) -> list[Region]:
        """Where the transport reads a held state or writes an arriving one (the one-rank layout)."""
        return self.area.regions(staged)

    def views(self) -> list[torch.Tensor]:
        """The area's whole memory: what a holder lets peers read."""
        return pool_views(self.area.kv, self.area.states)

    def _synchronize(self) -> None:
        """A transport reads the area from outside the engine's stream: what was written there must have landed."""
        if self.kv_pool.data.is_cuda:
            torch.cuda.current_stream(self.kv_pool.data.device).synchronize()


class TensorParallelHandoff(Handoff):
    """The leader's side: the hand-off area, and moving a request's state between it and the ranks."""

    def __init__(self, followers, kv_pool: KVPagePool, state_pool: StatePool, size: AreaSize):
        super().__init__(followers, kv_pool, state_pool, size)
        self.tp: TensorParallelGroup = followers.group

    def _make_area(self) -> HandoffArea:
        return HandoffArea(
            *one_rank_pools(self.tp.shard.full, self.kv_pool, self.state_pool, self.size.pages, self.size.states)
        )

    def gather(self, pages: list[int], slot: int, rank: int = 0) -> Staged:
        """The ranks' parts of a held request's state, merged into room taken in the area (stepping thread);
        PoolExhausted, before anything moves, when the area is full. Every rank holds a part of every request
        (`rank` is data_parallel.DataParallelHandoff's)."""
        staged = self.stage(len(pages))
        self.followers.send_gather(pages, slot)
        parts = gather_parts(self.tp, rank_state(self.kv_pool, self.state_pool, pages, slot))
        assert parts is not None, "the leader (rank 0) gathers every rank's part"
        self.area.write(staged, merge(parts, self.tp.shard.full, self.tp.shard.expert_parallel))
        self._synchronize()
        return staged

    def scatter(self, pages: list[int], slot: int, rank: int, staged: Staged) -> None:
        """An arrived state, from the area into each rank's pools (stepping thread)."""
        whole = self.area.read(staged)
        shard = self.tp.shard
        self.hand_out(
            pages,
            slot,
            [split(whole, Shard(shard.size, r, shard.full, shard.expert_parallel)) for r in range(shard.size)],
        )

    def takes_parts(self, size: int) -> bool:
        return size == self.tp.shard.size  # a rank holds the same heads and channels whatever the experts do

    def hand_out(self, pages: list[int], slot: int, parts: list[RequestState]) -> None:
        """Each rank its part of an arrived state, into its pools (stepping thread)."""
        self.followers.send_scatter(pages, slot)
        mine = scatter_parts(self.tp, parts[0], parts)
        store_rank_state(self.kv_pool, self.state_pool, pages, slot, mine)

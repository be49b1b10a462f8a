"""Held and arriving request state of a tensor-parallel engine, in the one-rank layout that travels.

Each rank holds its part of a request's state in its own pools (engine/state_shards.py says which part). What
a prefill worker offers and a decode worker receives is the state in the layout of a one-rank engine, so a
worker of any layout can pull it. The leader (rank 0) keeps that layout in pools of its own:

- prefill: when a request's state is held, `gather` brings every rank's part to the leader (torch.distributed
  gather over the engine's group) and merges them into `OneRankPools`, indexed by the same page ids and slots as
  the ranks' pools (no allocator of their own), which the transport offers. Made on the first held state; as
  large as the ranks' pools, which is why a parallel prefill worker is refused on CUDA.
- decode: space for an arriving state is taken in a small `ArrivalArea` of its own (a few states of the longest
  context); the transport pulls into it; before the request's first step, `scatter` splits the state and sends
  each rank its part (scatter over the group), which each rank writes into its own pools, and the area's space
  is given back.

Both run on the leader's stepping thread, which also sends the steps: the followers meet them in the same order
(engine/tp_workers.py), after every step launched before, so the state they read is final and what they write
is in place before the request's first step. The cost is one copy of the state through the leader.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from deltamesh.engine.cache import KVPagePool, PoolExhausted, Region, StatePool, pool_views
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.parallel import Shard, TensorParallelGroup
from deltamesh.engine.state_shards import RequestState, merge, split


def rank_state(kv_pool: KVPagePool, state_pool: StatePool, pages: list[int], slot: int) -> RequestState:
    """A copy of this rank's state of the request in `pages` and `slot`."""
    return RequestState(kv_pool.data[pages], state_pool.conv[slot].clone(), state_pool.recurrent[slot].clone())


def store_rank_state(kv_pool: KVPagePool, state_pool: StatePool, pages: list[int], slot: int,
                     state: RequestState) -> None:  # fmt: skip
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


class OneRankPools:
    """The pools of a one-rank engine of the same model (of the page and slot counts given, else those of
    `like_kv` and `like_states`): where the leader keeps the states that leave."""

    def __init__(self, full: ModelConfig, like_kv: KVPagePool, like_states: StatePool, num_pages: int | None = None,
                 num_slots: int | None = None):  # fmt: skip
        data, conv, recurrent = like_kv.data, like_states.conv, like_states.recurrent
        self.kv = KVPagePool(like_kv.num_pages if num_pages is None else num_pages, like_kv.page_size,
                             len(full.full_layers), full.num_key_value_heads, full.head_dim, data.dtype, data.device)  # fmt: skip
        self.states = StatePool(
            like_states.num_slots if num_slots is None else num_slots, len(full.linear_layers), full.conv_dim,
            full.linear_conv_kernel_dim, full.linear_num_value_heads, full.linear_key_head_dim,
            full.linear_value_head_dim, conv.dtype, recurrent.dtype, conv.device,
        )  # fmt: skip

    def read(self, pages: list[int], slot: int) -> RequestState:
        return rank_state(self.kv, self.states, pages, slot)

    def write(self, pages: list[int], slot: int, state: RequestState) -> None:
        store_rank_state(self.kv, self.states, pages, slot, state)

    def regions(self, pages: list[int], slot: int) -> list[Region]:
        return self.kv.regions(pages) + self.states.regions(slot)


@dataclass(frozen=True)
class Staged:
    """Where one arriving state waits in an ArrivalArea."""

    pages: list[int]
    slot: int


class ArrivalArea:
    """Where a parallel worker receives states: one-rank layout pools with their own allocator, room for a few
    states of the longest context (`Arrivals`), each taken when its space is reserved and given back once its
    rank or ranks took it, before its first step. Far smaller than a copy of the pools, which on a GPU take most
    of its memory."""

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

    def regions(self, staged: Staged) -> list[Region]:
        return self.kv.regions(staged.pages) + self.states.regions(staged.slot)


@dataclass(frozen=True)
class Arrivals:
    """The size of a parallel worker's ArrivalArea: room for `states` states and `pages` pages in all."""

    states: int
    pages: int

    @classmethod
    def of(cls, states: int, max_model_len: int, kv: KVPagePool, slots: StatePool) -> "Arrivals":
        """`states` states of the longest context, but no more than the pools could take at once."""
        return cls(min(states, slots.num_slots), min(states * kv.pages_for(max_model_len), kv.num_pages))


class Handoff:
    """What both parallel hand-offs share: the arrival area, made on the first arrival."""

    def __init__(self, followers, kv_pool: KVPagePool, state_pool: StatePool, arrivals: Arrivals):
        self.followers, self.kv_pool, self.state_pool, self.arrivals = followers, kv_pool, state_pool, arrivals
        self._area: ArrivalArea | None = None
        self._lock = threading.Lock()

    def _make_area(self) -> ArrivalArea:
        raise NotImplementedError

    @property
    def area(self) -> ArrivalArea:
        with self._lock:
            if self._area is None:
                self._area = self._make_area()
            return self._area

    def stage(self, num_pages: int) -> Staged:
        """Room for an arriving state of `num_pages` pages (any thread); PoolExhausted when there is none."""
        return self.area.take(num_pages)

    def unstage(self, staged: Staged) -> None:
        self.area.give_back(staged)

    def staged_regions(self, staged: Staged) -> list[Region]:
        """Where the transport writes the arriving state (the one-rank layout)."""
        return self.area.regions(staged)


class TensorParallelHandoff(Handoff):
    """The leader's side: the one-rank pools of held states, the arrival area, and moving a request's state
    between them and the ranks."""

    def __init__(self, followers, kv_pool: KVPagePool, state_pool: StatePool, arrivals: Arrivals):
        super().__init__(followers, kv_pool, state_pool, arrivals)
        self.tp: TensorParallelGroup = followers.group
        self._pools: OneRankPools | None = None

    def _make_area(self) -> ArrivalArea:
        a = self.arrivals
        pools = OneRankPools(self.tp.shard.full, self.kv_pool, self.state_pool, a.pages, a.states)
        return ArrivalArea(pools.kv, pools.states)

    @property
    def pools(self) -> OneRankPools:
        with self._lock:
            if self._pools is None:
                self._pools = OneRankPools(self.tp.shard.full, self.kv_pool, self.state_pool)
            return self._pools

    def gather(self, pages: list[int], slot: int, rank: int = 0) -> None:
        """The ranks' parts of a held request's state, merged into the one-rank pools (stepping thread). Every
        rank holds a part of every request (`rank` is data_parallel.DataParallelHandoff's)."""
        self.followers.send_gather(pages, slot)
        parts = gather_parts(self.tp, rank_state(self.kv_pool, self.state_pool, pages, slot))
        self.pools.write(pages, slot, merge(parts, self.tp.shard.full, self.tp.shard.expert_parallel))
        self._synchronize()

    def scatter(self, pages: list[int], slot: int, rank: int, staged: Staged) -> None:
        """An arrived state, from the arrival area into each rank's pools (stepping thread)."""
        whole = self.area.read(staged)
        shard = self.tp.shard
        parts = [split(whole, Shard(shard.size, r, shard.full, shard.expert_parallel)) for r in range(shard.size)]
        self.followers.send_scatter(pages, slot)
        mine = scatter_parts(self.tp, parts[0], parts)
        store_rank_state(self.kv_pool, self.state_pool, pages, slot, mine)

    def regions(self, pages: list[int], slot: int, rank: int = 0) -> list[Region]:
        return self.pools.regions(pages, slot)

    def views(self) -> list[torch.Tensor]:
        return pool_views(self.pools.kv, self.pools.states)

    def _synchronize(self) -> None:
        """A transport reads the one-rank pools from outside the engine's stream: the merge must have landed."""
        if self.kv_pool.data.is_cuda:
            torch.cuda.current_stream(self.kv_pool.data.device).synchronize()

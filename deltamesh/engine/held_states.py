"""Prefill side of the hand-off: the states of requests that finished after their first token (`hold_state`),
kept until a decode worker has pulled them (or their lease ended), and what a transport reads of them.

A one-rank engine keeps a held state where it is, in its pools (a page the prefix cache shares too: the transfer
only reads it). A parallel engine moves it into its hand-off area (tp_handoff.py) and frees the ranks' space;
while the area is full the request waits, its last output held back (`waiting`, tried again before every step).
A parallel engine whose transport reads the ranks' memory (`rank_memory`) leaves it where its ranks keep it:
each tensor-parallel rank's part, or a data-parallel state whole on its rank (`RankBytes`).

The stepping thread keeps states; any thread reads and releases them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deltamesh.engine.cache import KVPagePool, PoolExhausted, RankBytes, Region, StatePool, pool_views
from deltamesh.engine.interfaces import SchedulerInterface
from deltamesh.engine.request import Request, RequestOutput
from deltamesh.engine.tp_handoff import Handoff

if TYPE_CHECKING:
    from deltamesh.engine.tp_workers import RankMemory


class HeldStates:
    def __init__(
        self,
        scheduler: SchedulerInterface,
        handoff: Handoff | None,
        kv_pool: KVPagePool,
        state_pool: StatePool,
        rank_memory: dict[int, RankMemory],
        data_parallel: bool,
    ):
        """`kv_pool`, `state_pool`: the leader's; `rank_memory`: what each follower made readable of its pools,
        empty unless the transport reads the ranks' memory."""
        self.scheduler, self.handoff, self.kv_pool, self.state_pool = scheduler, handoff, kv_pool, state_pool
        self.rank_memory, self.data_parallel = rank_memory, data_parallel
        self._held: dict[str, Request] = {}
        self._lock = threading.Lock()
        # requests whose states wait for room in the hand-off area, with their last outputs (stepping thread)
        self.waiting: deque[tuple[Request, RequestOutput]] = deque()

    def drafts(self, request_id: str) -> list[int]:
        """A held request's drafts (Request.draft_ids); KeyError if not held."""
        with self._lock:
            return list(self._held[request_id].draft_ids)

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, req: Request) -> bool:
        """Keep a request's state for a puller (stepping thread). A parallel engine gathers it into its hand-off
        area and frees the ranks' space: False, nothing done, while the area is full; an error there leaves the
        state in the ranks' pools."""
        prompt_pages = self.kv_pool.pages_for(len(req.prompt_ids))
        if len(req.pages) > prompt_pages:  # speculative decoding's room for drafts past the prompt: not the state's
            self.scheduler.pools(req.dp_rank)[0].free(req.pages[prompt_pages:])
            req.pages = req.pages[:prompt_pages]
        if self.handoff is not None and not self.rank_memory:
            try:
                req.staged = self.handoff.gather(req.pages, req.held_slot, req.dp_rank)
            except PoolExhausted:
                return False
            self.scheduler.free(req)
        with self._lock:
            self._held[req.request_id] = req
        return True

    def forget_waiting(self, req: Request) -> None:
        """A waiting request that ends otherwise (aborted)."""
        if any(r is req for r, _ in self.waiting):
            self.waiting = deque(w for w in self.waiting if w[0] is not req)

    def get(self, request_id: str) -> Request | None:
        with self._lock:
            return self._held.get(request_id)

    def release(self, request_id: str) -> bool:
        """Free a held state (its lease ended); False if it was not held."""
        with self._lock:
            req = self._held.pop(request_id, None)
        if req is None:
            return False
        if self.handoff is not None and req.staged is not None:
            self.handoff.unstage(req.staged)
            req.staged = None
        self.scheduler.free(req)
        return True

    def regions(self, request_id: str) -> Sequence[Region | RankBytes]:
        """A held state's bytes, in hand-off order (KeyError if not held)."""
        req = self.get(request_id)
        if req is None:
            raise KeyError(request_id)
        if self.handoff is not None and req.staged is not None:  # a parallel engine's: in its hand-off area
            return self.handoff.staged_regions(req.staged)
        own = self.kv_pool.regions(req.pages) + self.state_pool.regions(req.held_slot)
        if not self.rank_memory:
            return own
        if self.data_parallel:  # where its rank keeps it, whole
            if not req.dp_rank:
                return own
            kv, states = self.scheduler.pools(req.dp_rank)
            return self._rank_bytes(req.dp_rank, kv.regions(req.pages) + states.regions(req.held_slot))
        # tensor parallel: every rank's part, in rank order (StateLayout.rank_parts)
        return own + [b for rank in sorted(self.rank_memory) for b in self._rank_bytes(rank, own)]

    def _rank_bytes(self, rank: int, regions: list[Region]) -> list[RankBytes]:
        """`regions` (kv runs, conv, recurrent) of pools shaped as rank `rank`'s (the leader's own, or its
        bookkeeping copy of a data-parallel rank's), at the same offsets in that rank's pools."""
        (kv, _), (conv, _), (recurrent, _) = self.rank_memory[rank].pools
        starts = [kv] * (len(regions) - 2) + [conv, recurrent]
        return [RankBytes(rank, start + int(r.tensor.storage_offset()), r.nbytes) for start, r in zip(starts, regions)]

    def pool_views(self) -> Sequence[torch.Tensor | RankBytes]:
        """What a holder lets peers read: each pool's whole memory (of a parallel engine: its hand-off area's, or
        every rank's pools when the transport reads the ranks' memory)."""
        if self.rank_memory:
            return pool_views(self.kv_pool, self.state_pool) + [
                RankBytes(rank, start, size)
                for rank, memory in sorted(self.rank_memory.items())
                for start, size in memory.pools
            ]
        return self.handoff.views() if self.handoff is not None else pool_views(self.kv_pool, self.state_pool)

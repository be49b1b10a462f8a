"""Decode side of the hand-off: pool space a worker reserves for a request state arriving from another worker (a
decode worker's pull from a prefill worker, or a prefill worker's pull of a conversation a decode worker kept),
gives back if the state never comes, and, before the request's first step, places where its ranks run it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from deltamesh.engine.cache import KVPagePool, PoolExhausted, Region, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.interfaces import SchedulerInterface
from deltamesh.engine.request import Request
from deltamesh.engine.state_shards import RequestState, merge, nbytes, part_shapes, unpack
from deltamesh.engine.tp_handoff import Handoff, Staged, one_rank_template, store_rank_state


@dataclass
class RankParts:
    """Where a state sent as its sender's tensor-parallel rank parts lands (state_shards.part_shapes, end to end
    in `flat`) until, before the request's first step, the engine hands them to its ranks (its own layout) or
    merges them into the one-rank layout."""

    shapes: list[RequestState]
    flat: torch.Tensor

    def unpacked(self) -> list[RequestState]:
        return unpack(self.flat, self.shapes)


@dataclass
class Reservation:
    """Pool space held for a request state arriving from another worker."""

    slot: int
    pages: list[int]
    regions: list[Region] = field(default_factory=list)
    # Recorded on the engine's stream when the space was taken. A step launched before then may still write
    # this memory (a request that ended while its next step ran ahead): nothing may write the regions from
    # outside that stream (a UCX pull) before `wait_ready`.
    ready: torch.cuda.Event | None = None
    rank: int = 0  # data-parallel attention: the rank whose pools these are
    staged: Staged | None = None  # a parallel engine: `regions` are this place of its hand-off area
    # a state sent as its sender's rank parts: `regions` are this RankParts' bytes, placed before the first step
    parts: RankParts | None = None

    def hand_to(self, request: Request) -> None:
        """The request runs in this space from now on (`EngineCore.submit_transferred`)."""
        request.slot, request.pages, request.dp_rank = self.slot, self.pages, self.rank
        request.staged, request.parts = self.staged, self.parts

    def wait_ready(self) -> None:
        """Block (GIL released) until no launched step can still write this space."""
        if self.ready is not None:
            self.ready.synchronize()

    async def wait_ready_async(self) -> None:
        """`wait_ready` off the event loop's thread."""
        if self.ready is not None:
            await asyncio.to_thread(self.ready.synchronize)


class Reservations:
    """Takes and gives back reserved space (any thread): a slot and pages of the scheduler's pools (of one rank,
    under data parallelism), and on a parallel engine the place in its hand-off area where the state lands before
    the ranks take it (tp_handoff.HandoffArea)."""

    def __init__(
        self,
        scheduler: SchedulerInterface,
        handoff: Handoff | None,
        kv_pool: KVPagePool,
        state_pool: StatePool,
        device: torch.device,
        full: ModelConfig,
    ):
        self.scheduler, self.handoff, self.kv_pool, self.state_pool = scheduler, handoff, kv_pool, state_pool
        self.device, self.full = device, full
        self._one_rank = one_rank_template(full, kv_pool, state_pool)  # shapes of an arriving state's parts

    def reserve(self, num_tokens: int, sender_parts: int = 0) -> Reservation:
        """Slot + pages for a `num_tokens` prompt state; raises PoolExhausted when they are not free.
        `sender_parts`: the state comes as that many tensor-parallel ranks' parts (0: in the one-rank layout);
        they land in a buffer of their own, merged before the request's first step.
        Nothing is written to them here: the pull fills every byte, from UCX's own CUDA stream, and a zeroing
        kernel queued on the engine's stream could land after it and wipe the pulled state."""
        rank, slot, pages = self.scheduler.reserve(num_tokens)
        staged = None
        if self.handoff is not None and not (sender_parts > 1 and self.handoff.takes_parts(sender_parts)):
            try:
                staged = self.handoff.stage(len(pages))
            except PoolExhausted:
                self.scheduler.cancel(rank, slot, pages)
                raise
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.default_stream(self.device))
        parts = None
        if sender_parts > 1:
            parts = self._parts(len(pages), sender_parts)
            regions = [Region(parts.flat, f"rank parts [{sender_parts}]")]
        elif self.handoff is not None and staged is not None:
            regions = self.handoff.staged_regions(staged)
        else:
            regions = self.kv_pool.regions(pages) + self.state_pool.regions(slot)
        return Reservation(slot, pages, regions, ready, rank, staged, parts)

    def _parts(self, num_pages: int, size: int) -> RankParts:
        """Room for `size` ranks' parts of a state of `num_pages` pages (in the one-rank layout's dtypes)."""
        shapes = part_shapes(self.full, self._one_rank, num_pages, size)
        return RankParts(shapes, torch.empty(sum(map(nbytes, shapes)), dtype=torch.uint8, device=self.device))

    def cancel(self, reservation: Reservation) -> None:
        if self.handoff is not None and reservation.staged is not None:
            self.handoff.unstage(reservation.staged)
        self.scheduler.cancel(reservation.rank, reservation.slot, reservation.pages)

    def place(self, req: Request) -> None:
        """Before the request's first step (stepping thread): a state that arrived as its sender's rank parts goes
        to the ranks as it is when they are this engine's own ranks' parts, else is merged into the one-rank
        layout (in the pools, or a parallel engine's hand-off area); a parallel engine's goes from the area to its
        rank or ranks. Its place in the area is given back whatever happens; an error leaves the request's own
        space to be freed."""
        if self.handoff is None and req.parts is None:
            return
        try:
            if req.parts is not None:
                parts, req.parts = req.parts.unpacked(), None
                if self.handoff is not None and self.handoff.takes_parts(len(parts)):
                    self.handoff.hand_out(req.pages, req.held_slot, parts)  # its own ranks' parts: as they came
                    return
                whole = merge(parts, self.full)
                if self.handoff is None:
                    store_rank_state(self.kv_pool, self.state_pool, req.pages, req.held_slot, whole)
                    return
                assert req.staged is not None, "reserve staged it: a parallel engine that takes no parts as they are"
                self.handoff.area.write(req.staged, whole)
            # (the first return above leaves only a parallel engine here, which staged the state: reserve)
            assert self.handoff is not None and req.staged is not None
            self.handoff.scatter(req.pages, req.held_slot, req.dp_rank, req.staged)
        finally:
            self.unstage(req)

    def discard(self, req: Request) -> None:
        """Free the space a request arrived with, never used (its id was a duplicate)."""
        self.unstage(req)
        self.scheduler.free(req)

    def unstage(self, req: Request) -> None:
        """Give back a request's place in the hand-off area: its state went to its ranks, or it never will."""
        if self.handoff is not None and req.staged is not None:
            self.handoff.unstage(req.staged)
            req.staged = None

"""The workers of one role, least loaded first, kept in that order as their loads change, so that a routing decision
finds the least loaded worker it may use without scoring every worker (router/policies.py): at 1,000 workers,
scoring each cost a router process 1.8 ms per decision (bench/RESULTS.md, "The router at scale").

The order is a heap of (load, worker) entries. A worker's handle pushes a new entry whenever its load changes
(router/registry.py: WorkerHandle); the entries it leaves behind are stale and are dropped when they reach the top,
or all at once when they outnumber the workers."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # registry.py imports this module
    from deltamesh.services.router.registry import WorkerHandle

# a handle's fields that its load score reads: setting one moves the handle in its order
SCORED_FIELDS = frozenset({"inflight", "admitted", "load"})


def load_score(w: WorkerHandle) -> tuple[int, float, str]:
    """Fewest requests: the most of what this router process has sent or admitted and not seen end, and of what the
    worker last reported running and queued (every router's requests, as of its report); then the lowest KV-page
    use; then the address, so that equal loads order alike in every process."""
    load = w.load
    reported = load.running + load.waiting if load else 0
    kv = load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0
    # a decode worker's admitted requests include those still prefilling elsewhere: bound here, not yet sent
    return (max(w.inflight, w.admitted, reported), kv, w.address)


class LoadOrder:
    def __init__(self, workers: Iterable[WorkerHandle] = ()):
        self._members: dict[str, WorkerHandle] = {}
        self._heap: list[tuple[tuple[int, float, str], int, WorkerHandle]] = []
        self._pushes = itertools.count()  # ties between entries of one score: never compare handles
        for w in workers:
            self.add(w)

    def __len__(self) -> int:
        return len(self._members)

    def get(self, address: str) -> WorkerHandle | None:
        return self._members.get(address)

    def members(self) -> Iterable[WorkerHandle]:
        return self._members.values()

    def add(self, w: WorkerHandle) -> None:
        self._members[w.address] = w
        self.moved(w)

    def remove(self, w: WorkerHandle) -> None:
        if self._members.get(w.address) is w:
            del self._members[w.address]  # its entries are stale from now on

    def moved(self, w: WorkerHandle) -> None:
        """`w`'s load changed: it takes its new place (its old entry goes stale)."""
        if self._members.get(w.address) is not w:
            return
        heapq.heappush(self._heap, (load_score(w), next(self._pushes), w))
        if len(self._heap) > 4 * len(self._members) + 64:
            self._compact()

    def least(self, accept: Callable[[WorkerHandle], bool]) -> WorkerHandle | None:
        """The least loaded worker that `accept` takes (None if none does): the workers it refuses are passed over,
        in load order, so the cost grows with how many are refused before one is taken, not with the workers."""
        heap, refused, found = self._heap, [], None
        while heap:
            score, _, w = heap[0]
            if self._members.get(w.address) is not w or score != load_score(w):
                heapq.heappop(heap)  # stale: the worker left, or a later entry holds its current load
                continue
            if accept(w):
                found = w
                break
            refused.append(heapq.heappop(heap))
        for entry in refused:
            heapq.heappush(heap, entry)
        return found

    def _compact(self) -> None:
        self._heap = [(load_score(w), next(self._pushes), w) for w in self._members.values()]
        heapq.heapify(self._heap)


@dataclass(frozen=True)
class Pool:
    """The workers one routing decision may choose from: those of `order` that `accept` takes (healthy, not tried
    yet, with room: whatever the caller requires)."""

    order: LoadOrder
    accept: Callable[[WorkerHandle], bool]

    @classmethod
    def of(cls, workers: Iterable[WorkerHandle]) -> Pool:
        """A pool of exactly these workers, ordered now (a list of candidates, as tests hold them: it costs a pass
        over them, so a router keeps its orders instead)."""
        return cls(LoadOrder(workers), lambda w: True)

    def least_loaded(self) -> WorkerHandle | None:
        return self.order.least(self.accept)

    def get(self, address: str) -> WorkerHandle | None:
        """The worker at `address` if it is in the pool."""
        w = self.order.get(address)
        return w if w is not None and self.accept(w) else None

    def workers(self) -> list[WorkerHandle]:
        """Every worker in the pool (a pass over the role's workers)."""
        return [w for w in self.order.members() if self.accept(w)]


def as_pool(candidates: Pool | Iterable[WorkerHandle]) -> Pool:
    return candidates if isinstance(candidates, Pool) else Pool.of(candidates)

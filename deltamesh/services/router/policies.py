"""Routing policies: pick one worker out of the healthy candidates."""

from __future__ import annotations

import itertools
from typing import Protocol

from deltamesh.services.router.registry import WorkerHandle


class Policy(Protocol):
    def pick(self, candidates: list[WorkerHandle]) -> WorkerHandle: ...


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, candidates: list[WorkerHandle]) -> WorkerHandle:
        ordered = sorted(candidates, key=lambda w: w.address)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoaded:
    """Fewest requests in flight (what the router has sent and not seen end, plus what the worker last
    reported queued), then the lowest KV-page use."""

    def pick(self, candidates: list[WorkerHandle]) -> WorkerHandle:
        def score(w: WorkerHandle):
            load = w.load
            queued = load.waiting if load else 0
            kv = load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0
            return (w.inflight + queued, kv, w.address)

        return min(candidates, key=score)


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}

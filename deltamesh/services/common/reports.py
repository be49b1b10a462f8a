"""What a worker tells the routers that watch it (WorkerReports.Watch, protos/deltamesh/v1/control.proto): its load,
the prefixes its cache holds and, if it holds state for pullers, its holder descriptor (which the routers announce
to the workers that pull from it), pushed over one stream per watching router process.

Each process of each router the worker registered with watches it, so a worker has as many streams as its routers
have processes. One `ReportSource` samples the load and the cache's resume keys for all of them, at most once per
half the shortest interval asked, and keeps what changed between its samples for a while: a stream sends the whole
set of keys once, then only the keys added and removed since its previous report, and nothing at all while neither
the load nor the keys change, but for a report every REPORT_KEEPALIVE_INTERVALS intervals that tells the router the
worker is alive (a router counts a worker that stays silent for longer as failed: router/registry.py). The streams
open now are counted by the id of the router process watching (`Watchers`): a worker registers again with a process
that stops watching it (services/common/registration.py), and need not otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc

REPORT_KEEPALIVE_INTERVALS = 4  # a report at least this often (in intervals), changed or not
MIN_INTERVAL_S = 0.02  # the shortest interval a watcher may ask for
DEFAULT_INTERVAL_S = 0.5
HISTORY = 256  # samples whose changes are kept: a stream further behind gets the whole set again


@dataclass(frozen=True)
class Sample:
    number: int
    at: float
    load: common_pb2.WorkerLoad
    keys: frozenset[int]
    holder: common_pb2.TransportDescriptor | None = None


class ReportSource:
    """The worker's load, resume keys and holder descriptor, sampled on demand and shared by every stream."""

    def __init__(
        self,
        load: Callable[[], common_pb2.WorkerLoad],
        keys: Callable[[], set[int]],
        holder: Callable[[], common_pb2.TransportDescriptor | None] = lambda: None,
    ):
        self._load, self._keys, self._holder = load, keys, holder
        self._sample = Sample(0, 0.0, common_pb2.WorkerLoad(), frozenset())
        self._changes: deque[tuple[int, frozenset[int], frozenset[int]]] = deque(maxlen=HISTORY)

    def sample(self, max_age_s: float) -> Sample:
        """The latest sample, taken now if the last is older than `max_age_s`."""
        now = time.monotonic()
        if self._sample.number and now - self._sample.at < max_age_s:
            return self._sample
        keys = frozenset(self._keys())
        old = self._sample
        if keys != old.keys:
            self._changes.append((old.number + 1, keys - old.keys, old.keys - keys))
        self._sample = Sample(old.number + 1, now, self._load(), keys, self._holder())
        return self._sample

    def changes(self, since: int) -> tuple[set[int], set[int]] | None:
        """(added, removed) between sample `since` and the latest, or None when they are no longer kept."""
        if since < self._sample.number - HISTORY:
            return None
        added: set[int] = set()
        removed: set[int] = set()
        for number, a, r in self._changes:
            if number <= since:
                continue
            for k in r:
                if k in added:
                    added.discard(k)
                else:
                    removed.add(k)
            for k in a:
                if k in removed:
                    removed.discard(k)
                else:
                    added.add(k)
        return added, removed


class Watchers:
    """The report streams open now, by the id of the router process that opened each (WatchRequest.router_id)."""

    def __init__(self):
        self._open: Counter[str] = Counter()

    def watching(self, router_id: str) -> bool:
        return self._open[router_id] > 0

    @contextlib.contextmanager
    def stream(self, router_id: str) -> Iterator[None]:
        self._open[router_id] += 1
        try:
            yield
        finally:  # the stream ended, was cancelled, or its connection broke (the router process gone)
            self._open[router_id] -= 1
            if not self._open[router_id]:
                del self._open[router_id]


class ReportsServicer(control_pb2_grpc.WorkerReportsServicer):
    def __init__(self, source: ReportSource, watchers: Watchers | None = None):
        self.source = source
        self.watchers = watchers or Watchers()

    async def Watch(self, request: control_pb2.WatchRequest, context):
        with self.watchers.stream(request.router_id):
            interval = max(request.interval_ms / 1000, MIN_INTERVAL_S) if request.interval_ms else DEFAULT_INTERVAL_S
            seen: Sample | None = None  # the sample the last report was made from
            quiet = 0  # intervals since the last report
            while True:
                sample = self.source.sample(interval / 2)
                changes = self.source.changes(seen.number) if seen is not None else None
                if changes is None:  # the first report, or one too far behind for the changes: the whole set
                    report = control_pb2.WorkerReport(load=sample.load, prefixes_whole=True, prefixes_added=sample.keys)
                else:
                    added, removed = changes
                    report = control_pb2.WorkerReport(load=sample.load, prefixes_added=added, prefixes_removed=removed)
                if sample.holder is not None:
                    report.holder.CopyFrom(sample.holder)
                changed = (
                    seen is None
                    or changes is None
                    or changes != (set(), set())
                    or (sample.load, sample.holder) != (seen.load, seen.holder)
                )
                if changed or quiet + 1 >= REPORT_KEEPALIVE_INTERVALS:
                    yield report
                    seen, quiet = sample, 0
                else:
                    quiet += 1
                await asyncio.sleep(interval)

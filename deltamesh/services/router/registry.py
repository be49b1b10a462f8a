"""The router's view of its workers: given by flags (static) or registered by the workers themselves
(dynamic, kept alive by repeated registration). The router watches every worker it knows (WorkerReports.Watch): the
worker pushes its load and the prefixes its cache holds (services/common/reports.py), which every process of every
router receives alike, so no process depends on another for its view of the mesh. A worker whose stream breaks, or
that a call found dead, is left out of routing until a new stream's first report; one that stays silent on its
stream for MAX_SILENT_REPORTS report intervals (a stopped process, or a loop held by long work) is out too."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

import grpc
import structlog

from deltamesh.services.common.auth import mesh_metadata
from deltamesh.services.common.reports import REPORT_KEEPALIVE_INTERVALS
from deltamesh.services.common.server import CHANNEL_OPTIONS
from deltamesh.services.common.tls import aio_channel
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc

log = structlog.get_logger("deltamesh.registry")

ROLES = ("prefill", "decode", "colocated")
MAX_MISSED_HEARTBEATS = 5  # a registered worker that stops registering for this many intervals is dropped
MAX_SILENT_REPORTS = 5  # a worker silent on its report stream for this many keep-alive periods is out of routing


@dataclass
class WorkerHandle:
    address: str
    role: str
    static: bool
    channel: grpc.aio.Channel
    compat_hash: str = ""
    # a registered prefill worker's transport descriptor, passed on to decode workers unread
    transport: common_pb2.TransportDescriptor | None = None
    healthy: bool = False
    load: common_pb2.WorkerLoad | None = None
    last_registered: float = field(default_factory=time.monotonic)
    last_report: float = 0.0  # when its report stream last delivered
    watch: asyncio.Task | None = None  # the task reading its report stream
    inflight: int = 0  # requests the router has sent here and not yet seen end

    # stubs made once: making one per call costs more than the call's own Python work
    @functools.cached_property
    def stub(self):
        if self.role == "prefill":
            return prefill_pb2_grpc.PrefillWorkerStub(self.channel)
        return decode_pb2_grpc.DecodeWorkerStub(self.channel)

    @functools.cached_property
    def reports(self) -> control_pb2_grpc.WorkerReportsStub:
        return control_pb2_grpc.WorkerReportsStub(self.channel)


class WorkerRegistry:
    def __init__(self, health_interval_s: float, heartbeat_interval_s: float, mesh_secret: str, tls=None):
        """`health_interval_s`: how often workers report (at most) and how often the registry tends its workers;
        `heartbeat_interval_s`: how often registered workers must register again."""
        self.tls, self._secret = tls, mesh_secret
        self.health_interval_s = health_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.workers: dict[str, WorkerHandle] = {}
        self.index = PrefixIndex()  # what the workers' prefix caches hold, as they report it
        self._closing: set[asyncio.Task] = set()

    def add(self, address: str, role: str, static: bool, compat_hash: str = "") -> WorkerHandle:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; roles are {', '.join(ROLES)}")
        w = self.workers.get(address)
        if w is not None and w.role != role:
            self._drop(w)
            w = None
        if w is None:
            w = WorkerHandle(address, role, static, aio_channel(address, self.tls, CHANNEL_OPTIONS))
            self.workers[address] = w
            log.info("worker added", address=address, role=role, static=static)
            self._start_watch(w)
        w.compat_hash = compat_hash or w.compat_hash
        w.last_registered = time.monotonic()
        return w

    def _drop(self, w: WorkerHandle) -> None:
        self.workers.pop(w.address, None)
        w.healthy = False  # for whoever still holds it
        if w.watch is not None:
            w.watch.cancel()
        task = asyncio.get_running_loop().create_task(self._close_when_idle(w))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        log.info("worker removed", address=w.address, role=w.role)

    @staticmethod
    async def _close_when_idle(w: WorkerHandle, limit_s: float = 600.0) -> None:
        """Closing a channel cancels its calls: let the requests already on it finish first."""
        deadline = time.monotonic() + limit_s
        while w.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await w.channel.close()

    def call_metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """Metadata of a call to a worker: the mesh secret (workers refuse calls without it) and the request id."""
        return mesh_metadata(self._secret, request_id)

    def healthy(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def mark_failed(self, w: WorkerHandle, why: str) -> None:
        if w.healthy:
            log.warning("worker failed", address=w.address, role=w.role, why=why)
        w.healthy = False

    async def poll_forever(self, stop: asyncio.Event) -> None:
        """Tend the workers every health interval until `stop`: see `tend`."""
        while not stop.is_set():
            self.tend()
            try:
                await asyncio.wait_for(stop.wait(), self.health_interval_s)
            except TimeoutError:
                pass
        for w in self.workers.values():
            if w.watch is not None:
                w.watch.cancel()

    def tend(self) -> None:
        """Drop registered workers that stopped registering, count silent ones as failed, and watch again every
        worker whose stream ended."""
        now = time.monotonic()
        silent_s = MAX_SILENT_REPORTS * REPORT_KEEPALIVE_INTERVALS * self.health_interval_s
        for w in list(self.workers.values()):
            if not w.static and now - w.last_registered > MAX_MISSED_HEARTBEATS * self.heartbeat_interval_s:
                self._drop(w)
            elif w.watch is None or w.watch.done():
                self._start_watch(w)
            elif w.healthy and now - w.last_report > silent_s:
                self.mark_failed(w, f"no report for {now - w.last_report:.1f} s")

    def _start_watch(self, w: WorkerHandle) -> None:
        w.watch = asyncio.get_running_loop().create_task(self._watch(w))

    async def _watch(self, w: WorkerHandle) -> None:
        """Take in the worker's reports until its stream ends; it is out of routing from then until the next."""
        interval_ms = max(1, round(self.health_interval_s * 1000))
        try:
            call = w.reports.Watch(control_pb2.WatchRequest(interval_ms=interval_ms), metadata=self.call_metadata())
            async for report in call:
                self._take(w, report)
            self.mark_failed(w, "report stream ended")
        except grpc.aio.AioRpcError as e:
            self.mark_failed(w, e.code().name)
        finally:
            self.index.forget(w.address)

    def _take(self, w: WorkerHandle, report: control_pb2.WorkerReport) -> None:
        w.load = report.load
        w.last_report = time.monotonic()
        if report.prefixes_whole:
            self.index.replace(w.address, report.prefixes_added)
        else:
            self.index.remove(w.address, report.prefixes_removed)
            self.index.add(w.address, report.prefixes_added)
        if not w.healthy:
            log.info("worker healthy", address=w.address, role=w.role)
        w.healthy = True

    def loads(self) -> list[common_pb2.WorkerLoad]:
        out = []
        for w in self.workers.values():
            load = common_pb2.WorkerLoad()
            if w.load is not None:
                load.CopyFrom(w.load)
            load.address, load.role, load.healthy = w.address, w.role, w.healthy
            load.prefixes = self.index.keys_of(w.address)
            out.append(load)
        return out

    async def close(self) -> None:
        for w in self.workers.values():
            if w.watch is not None:
                w.watch.cancel()
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()), return_exceptions=True)

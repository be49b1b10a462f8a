"""The router's view of its workers: given by flags (static) or registered by the workers themselves
(dynamic, kept alive by their reports, or by registering again). The router watches every worker it knows
(WorkerReports.Watch): the worker pushes its load and the prefixes its cache holds (services/common/reports.py),
which every process of every router receives alike, so no process depends on another for its view of the mesh. A
worker whose stream breaks, or that a call found dead, is left out of routing until a new stream's first report; one
that stays silent on its stream for MAX_SILENT_REPORTS report intervals (a stopped process, or a loop held by long
work) is out too.

A registered worker stays registered while its reports come (their keep-alives included), or while it registers
again: it registers again only while this process does not watch it (services/common/registration.py: the id of
this process, `id`, names its streams to the worker). One heard from by neither for MAX_MISSED_HEARTBEATS heartbeat
intervals is dropped.

The reports also carry the side channel's announcements (docs/notes/side-channel-security.md): a worker that holds
state for pullers reports its holder descriptor, and the router names the holders of the role a puller pulls from
(decode workers pull from prefill workers; prefill workers from decode workers, the prefixes they offer) in a
GetLoads call to that puller whenever they change, and again on each new report stream (a restarted worker knows
none). Pullers refuse the leases of holders never announced to them. No two workers may claim one transport endpoint
(`TransportDescriptor.endpoints`: for UCX, a worker's and its ranks' UCX worker addresses): a worker whose
description names an endpoint another worker's names is left out of routing and announced to no one, so that a
caller holding the mesh secret cannot pose as the holder of another worker's memory."""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from deltamesh.services.common.auth import mesh_metadata
from deltamesh.services.common.reports import REPORT_KEEPALIVE_INTERVALS
from deltamesh.services.common.server import CHANNEL_OPTIONS
from deltamesh.services.common.tls import aio_channel
from deltamesh.services.router.load_order import SCORED_FIELDS, LoadOrder, Pool
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc

log = structlog.get_logger("deltamesh.registry")

ROLES = ("prefill", "decode", "colocated")
MAX_MISSED_HEARTBEATS = 5  # a registered worker neither reporting nor registering for this many intervals is dropped
MAX_SILENT_REPORTS = 5  # a worker silent on its report stream for this many keep-alive periods is out of routing
PULLS_FROM = {"decode": "prefill", "prefill": "decode"}  # a role -> the role whose held states it pulls


@dataclass
class WorkerHandle:
    address: str
    role: str
    static: bool
    channel: grpc.aio.Channel
    compat_hash: str = ""
    # its holder descriptor (from its reports), announced to the workers pulling from its role; read by no one here
    holder: common_pb2.TransportDescriptor | None = None
    healthy: bool = False
    load: common_pb2.WorkerLoad | None = None
    last_registered: float = field(default_factory=time.monotonic)
    last_report: float = 0.0  # when its report stream last delivered
    watch: asyncio.Task | None = None  # the task reading its report stream
    inflight: int = 0  # requests the router has sent here and not yet seen end
    admitted: int = 0  # decode: requests admitted here (router/admission.py), prefilling or decoding
    refused: bool = False  # its holder descriptor claims another worker's endpoint: never routed to or announced
    # a puller: the holders to announce to it (by address), and whether a call is under way
    to_announce: dict[str, common_pb2.TransportDescriptor] = field(default_factory=dict)
    announcing: bool = False
    order: LoadOrder | None = field(default=None, repr=False, compare=False)  # its role's, in the registry
    feeds: Any = field(default=None, repr=False, compare=False)  # its token feed from this process (router/feeds.py)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        # a new load moves it in its role's order: whoever changes a count (legs.py, admission.py) need not know
        if name in SCORED_FIELDS and (order := self.__dict__.get("order")) is not None:
            order.moved(self)

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
        `heartbeat_interval_s`: a registered worker neither reporting nor registering for MAX_MISSED_HEARTBEATS of
        these is dropped."""
        self.tls, self._secret = tls, mesh_secret
        self.id = secrets.token_hex(8)  # this process's, this run: the workers match their report streams to it
        self.health_interval_s = health_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.workers: dict[str, WorkerHandle] = {}
        self.orders = {role: LoadOrder() for role in ROLES}  # each role's workers, least loaded first
        self.index = PrefixIndex()  # what the workers' prefix caches hold, as they report it
        self._closing: set[asyncio.Task] = set()
        # called with a worker after each of its reports and when it is marked failed (router/admission.py)
        self.listeners: list[Callable[[WorkerHandle], None]] = []

    def add(self, address: str, role: str, static: bool, compat_hash: str = "") -> WorkerHandle:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; roles are {', '.join(ROLES)}")
        w = self.workers.get(address)
        if w is not None and w.role != role:
            self._drop(w)
            w = None
        if w is None:
            w = self.keep(WorkerHandle(address, role, static, aio_channel(address, self.tls, CHANNEL_OPTIONS)))
            log.info("worker added", address=address, role=role, static=static)
            self._start_watch(w)
        w.compat_hash = compat_hash or w.compat_hash
        w.last_registered = time.monotonic()
        return w

    def keep(self, w: WorkerHandle) -> WorkerHandle:
        """Take in a new worker's handle: routing sees it (by its role's order) from now on."""
        self.workers[w.address] = w
        w.order = self.orders[w.role]
        w.order.add(w)
        return w

    def _drop(self, w: WorkerHandle) -> None:
        self.workers.pop(w.address, None)
        self.orders[w.role].remove(w)
        w.order = None
        w.healthy = False  # for whoever still holds it
        if w.watch is not None:
            w.watch.cancel()
        task = asyncio.get_running_loop().create_task(self._close_when_idle(w))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        log.info("worker removed", address=w.address, role=w.role)

    @staticmethod
    async def _close_when_idle(w: WorkerHandle, limit_s: float = 600.0) -> None:
        """Closing a channel cancels its calls: let the requests already on it finish first, and those admitted to
        it (router/admission.py) that have not called it yet, which would find its channel closed."""
        deadline = time.monotonic() + limit_s
        while (w.inflight or w.admitted) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await w.channel.close()

    def call_metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        """Metadata of a call to a worker: the mesh secret (workers refuse calls without it) and the request id."""
        return mesh_metadata(self._secret, request_id)

    def healthy(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def pool(self, role: str, accept: Callable[[WorkerHandle], bool] = lambda w: True) -> Pool:
        """The healthy workers of `role` that `accept` takes, for a routing decision (no pass over the workers)."""
        return Pool(self.orders[role], lambda w: w.healthy and accept(w))

    def has_healthy(self, role: str) -> bool:
        return self.pool(role).least_loaded() is not None

    def mark_failed(self, w: WorkerHandle, why: str) -> None:
        if w.healthy:
            log.warning("worker failed", address=w.address, role=w.role, why=why)
        w.healthy = False
        self._tell(w)

    def _tell(self, w: WorkerHandle) -> None:
        for listener in self.listeners:
            listener(w)

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
        """Drop registered workers heard from neither by report nor by registration, count silent ones as failed,
        watch again every worker whose stream ended, and announce again where an announcement failed."""
        now = time.monotonic()
        silent_s = MAX_SILENT_REPORTS * REPORT_KEEPALIVE_INTERVALS * self.health_interval_s
        for w in list(self.workers.values()):
            heard = max(w.last_registered, w.last_report)
            if not w.static and now - heard > MAX_MISSED_HEARTBEATS * self.heartbeat_interval_s:
                self._drop(w)
            elif w.watch is None or w.watch.done():
                self._start_watch(w)
            elif w.healthy and now - w.last_report > silent_s:
                self.mark_failed(w, f"no report for {now - w.last_report:.1f} s")
            else:
                self._announce(w)

    def _start_watch(self, w: WorkerHandle) -> None:
        w.watch = asyncio.get_running_loop().create_task(self._watch(w))

    async def _watch(self, w: WorkerHandle) -> None:
        """Take in the worker's reports until its stream ends; it is out of routing from then until the next."""
        interval_ms = max(1, round(self.health_interval_s * 1000))
        # a new stream may be a restarted worker's, which knows no holder: all of them again
        source = PULLS_FROM.get(w.role)
        w.to_announce = {
            o.address: o.holder for o in self.workers.values() if o.role == source and o.holder is not None
        }
        try:
            request = control_pb2.WatchRequest(interval_ms=interval_ms, router_id=self.id)
            call = w.reports.Watch(request, metadata=self.call_metadata())
            async for report in call:
                self._take(w, report)
            self.mark_failed(w, "report stream ended")
        except grpc.aio.AioRpcError as e:
            self.mark_failed(w, e.code().name)
        finally:
            self.index.forget(w.address)

    def _take(self, w: WorkerHandle, report: control_pb2.WorkerReport) -> None:
        w.last_report = time.monotonic()  # alive, refused or not: a refused worker stays known, as it registered
        before = w.holder
        reported = report.holder if report.HasField("holder") else None
        if reported != before and not self.record_holder(w, reported):
            if not w.refused:  # logged once, not at every report
                log.warning(
                    "worker refused: its side channel names a process another worker holds state in",
                    address=w.address,
                    role=w.role,
                )
            w.refused, w.healthy = True, False
            return
        w.refused = False
        w.load = report.load
        if report.prefixes_whole:
            self.index.replace(w.address, report.prefixes_added)
        else:
            self.index.remove(w.address, report.prefixes_removed)
            self.index.add(w.address, report.prefixes_added)
        if not w.healthy:
            log.info("worker healthy", address=w.address, role=w.role)
        w.healthy = True
        self._tell(w)
        if w.holder != before and w.holder is not None:  # its pullers learn of it now, not at the next tend
            for puller in self.workers.values():
                if PULLS_FROM.get(puller.role) == w.role:
                    puller.to_announce[w.address] = w.holder
                    self._announce(puller)
        self._announce(w)

    def announcements(self, role: str) -> list[common_pb2.TransportDescriptor]:
        """The holders a worker of `role` may pull from."""
        source = PULLS_FROM.get(role)
        return [w.holder for w in self.workers.values() if w.role == source and w.holder is not None]

    def record_holder(self, w: WorkerHandle, described: common_pb2.TransportDescriptor | None) -> bool:
        """Record the holder descriptor `w` reported (None: it holds nothing); False (and nothing recorded) if it
        names a transport endpoint that another worker's names, or none at all."""
        w.holder = None
        if described is None:
            return True
        claimed = {e for o in self.workers.values() if o is not w and o.holder is not None for e in o.holder.endpoints}
        if not described.endpoints or claimed & set(described.endpoints):
            return False
        w.holder = described
        return True

    def _announce(self, w: WorkerHandle) -> None:
        """Tell a healthy puller the holders it was not told of yet (announcements add up at the puller: only the
        new ones travel, so a mesh of W workers costs O(W) announcements as they start, not O(W) per change)."""
        if not w.to_announce or not w.healthy or w.announcing:
            return
        w.announcing = True
        task = asyncio.get_running_loop().create_task(self._send_announcements(w))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _send_announcements(self, w: WorkerHandle) -> None:
        """Announce until none is left to tell (holders may come during a call); what a failed call carried is
        tried again at the next tend."""
        batch: dict[str, common_pb2.TransportDescriptor] = {}
        try:
            while w.healthy and w.to_announce:
                batch, w.to_announce = w.to_announce, {}
                request = common_pb2.GetLoadsRequest(holders=list(batch.values()))
                await w.stub.GetLoads(
                    request, metadata=self.call_metadata(), timeout=max(self.health_interval_s * 4, 2.0)
                )
                batch = {}
        except grpc.aio.AioRpcError as e:
            log.warning("announcing holders failed", address=w.address, role=w.role, code=e.code().name)
            w.to_announce = {**batch, **w.to_announce}
        finally:
            w.announcing = False

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

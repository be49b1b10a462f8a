"""The router's view of its workers: given by flags (static) or registered by the workers themselves
(dynamic, kept alive by repeated registration). A poller checks every worker's loads; a worker that does not
answer, or that a call found dead, is left out of routing until it answers again.

The poll also carries the side channel's announcements (docs/notes/side-channel-security.md): a worker that holds
state for pullers answers with its holder descriptor, and each poll of a worker that pulls names the holders of the
role it pulls from (decode workers pull from prefill workers; prefill workers from decode workers, the prefixes
they offer). Pullers refuse the leases of holders never announced to them. No two workers may claim one transport
endpoint (`TransportDescriptor.endpoints`: for UCX, a worker's and its ranks' UCX worker addresses): a worker whose
description names an endpoint another worker's names is left out of routing and announced to no one, so that a
caller holding the mesh secret cannot pose as the holder of another worker's memory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from deltamesh.services.common.auth import mesh_metadata
from deltamesh.services.common.server import CHANNEL_OPTIONS
from deltamesh.services.common.tls import aio_channel
from deltamesh.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = structlog.get_logger("deltamesh.registry")

ROLES = ("prefill", "decode", "colocated")
MAX_MISSED_POLLS = 5
PULLS_FROM = {"decode": "prefill", "prefill": "decode"}  # a role -> the role whose held states it pulls


@dataclass
class WorkerHandle:
    address: str
    role: str
    static: bool
    channel: grpc.aio.Channel
    compat_hash: str = ""
    # its holder descriptor (from its load poll), announced to the workers pulling from its role; read by no one here
    holder: common_pb2.TransportDescriptor | None = None
    healthy: bool = False
    load: common_pb2.WorkerLoad | None = None
    last_registered: float = field(default_factory=time.monotonic)
    inflight: int = 0  # requests the router has sent here and not yet seen end
    admitted: int = 0  # decode: requests admitted here (router/admission.py), prefilling or decoding
    missed_polls: int = 0  # consecutive load polls without an answer in time
    refused: bool = False  # its holder descriptor claims another worker's endpoint: never routed to or announced

    @property
    def stub(self):
        if self.role == "prefill":
            return prefill_pb2_grpc.PrefillWorkerStub(self.channel)
        return decode_pb2_grpc.DecodeWorkerStub(self.channel)


class WorkerRegistry:
    def __init__(self, health_interval_s: float, heartbeat_interval_s: float, mesh_secret: str, tls=None):
        self.tls, self._secret = tls, mesh_secret
        self.health_interval_s = health_interval_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.workers: dict[str, WorkerHandle] = {}
        self._closing: set[asyncio.Task] = set()
        # called with a worker after each of its load polls and when it is marked failed (router/admission.py)
        self.listeners: list[Callable[[WorkerHandle], None]] = []

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
        w.compat_hash = compat_hash or w.compat_hash
        w.last_registered = time.monotonic()
        return w

    def _drop(self, w: WorkerHandle) -> None:
        self.workers.pop(w.address, None)
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
        self._tell(w)

    def _tell(self, w: WorkerHandle) -> None:
        for listener in self.listeners:
            listener(w)

    async def poll_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll_once()
            try:
                await asyncio.wait_for(stop.wait(), self.health_interval_s)
            except TimeoutError:
                pass

    async def poll_once(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):  # dynamic workers that stopped registering are gone
            if not w.static and now - w.last_registered > MAX_MISSED_POLLS * self.heartbeat_interval_s:
                self._drop(w)
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    def announcements(self, role: str) -> list[common_pb2.TransportDescriptor]:
        """The holders a worker of `role` may pull from."""
        source = PULLS_FROM.get(role)
        return [w.holder for w in self.workers.values() if w.role == source and w.holder is not None]

    def record_holder(self, w: WorkerHandle, described: common_pb2.TransportDescriptor | None) -> bool:
        """Record the holder descriptor `w` answered (None: it holds nothing); False (and nothing recorded) if it
        names a transport endpoint that another worker's names, or none at all."""
        w.holder = None
        if described is None:
            return True
        claimed = {e for o in self.workers.values() if o is not w and o.holder is not None for e in o.holder.endpoints}
        if not described.endpoints or claimed & set(described.endpoints):
            return False
        w.holder = described
        return True

    async def _check(self, w: WorkerHandle) -> None:
        """A worker that is unreachable is out at once; one that is only slow to answer (a long engine step,
        kernel compilation) is out after MAX_MISSED_POLLS polls in a row."""
        try:
            reply = await w.stub.GetLoads(
                common_pb2.GetLoadsRequest(holders=self.announcements(w.role)),
                metadata=self.call_metadata(),
                timeout=max(self.health_interval_s * 4, 2.0),
            )
            if not self.record_holder(w, reply.holder if reply.HasField("holder") else None):
                if not w.refused:  # logged once, not at every poll
                    log.warning(
                        "worker refused: its side channel names a process another worker holds state in",
                        address=w.address,
                        role=w.role,
                    )
                w.refused, w.healthy = True, False
                return
            w.refused = False
            w.load = reply.workers[0]
            w.missed_polls = 0
            if not w.healthy:
                log.info("worker healthy", address=w.address, role=w.role)
            w.healthy = True
            self._tell(w)
        except grpc.aio.AioRpcError as e:
            w.missed_polls += 1
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or w.missed_polls >= MAX_MISSED_POLLS:
                self.mark_failed(w, e.code().name)

    def loads(self) -> list[common_pb2.WorkerLoad]:
        out = []
        for w in self.workers.values():
            load = common_pb2.WorkerLoad()
            if w.load is not None:
                load.CopyFrom(w.load)
            load.address, load.role, load.healthy = w.address, w.role, w.healthy
            out.append(load)
        return out

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()), return_exceptions=True)

"""When a worker registers (again) with one router process.

A router process learns of a worker when it registers, then watches it (WorkerReports.Watch): the reports, whose
keep-alives come every few seconds, tell it the worker is alive, so registering again while that process watches
would tell it nothing. A worker registers at its start, then at every half heartbeat interval while the process does
not watch it: until the process's first stream opens, and again as soon as its streams end (the process restarted,
or dropped the worker, or the connection broke). Before this, every worker registered with every router process
twice a heartbeat interval: W workers x N processes x 2 calls a second, three times the report messages of an idle
mesh (bench/RESULTS.md, "The router at scale").

A router that gives no id in its reply (one from before this) counts only registrations: it is called every half
interval, as before. What a worker registers and the mesh secret its calls carry are unchanged."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from deltamesh.services.common.auth import mesh_metadata
from deltamesh.services.common.reports import Watchers
from deltamesh.services.common.server import CHANNEL_OPTIONS
from deltamesh.services.common.tls import aio_channel
from deltamesh.v1 import control_pb2, control_pb2_grpc

log = structlog.get_logger("deltamesh.worker")

FIRST_INTERVAL_S = 1.0  # between attempts until a router process first answers (it tells the interval)


class RegistrationPace:
    """One worker's registrations with one router process."""

    def __init__(self, watchers: Watchers):
        self.watchers = watchers
        self.router_id = ""  # the process's id, once it answered
        self.interval_s = FIRST_INTERVAL_S

    def registered(self, reply: control_pb2.RegisterWorkerResponse) -> None:
        self.router_id = reply.router_id
        self.interval_s = max(reply.heartbeat_interval_ms / 1000 / 2, 0.05)

    def failed(self) -> None:
        """The process did not answer: it may be a new one (restarted) by the next call."""
        self.router_id = ""

    def due(self) -> bool:
        """Whether to call the process now (asked every `interval_s`)."""
        return not self.router_id or not self.watchers.watching(self.router_id)


class Registration:
    """A worker's registrations with every router it knows of: the control-plane addresses of --router
    (comma-separated: several router hosts), and every process of each of those routers, which their replies name
    (`--api-server-count`). Survives router restarts."""

    def __init__(self, request: control_pb2.RegisterWorkerRequest, mesh_secret: str, tls, watchers: Watchers):
        self.request, self.tls, self.watchers = request, tls, watchers
        self._auth = mesh_metadata(mesh_secret)
        self.refused: str | None = None  # why a router will not take this worker, once one said so
        self.calls = 0  # registration calls answered

    async def run(self, routers: list[str], stop: asyncio.Event) -> None:
        """Until `stop` (which a router refusing the mesh secret sets)."""
        loops: dict[str, asyncio.Task] = {}

        def know(address: str) -> None:
            if address not in loops:
                loops[address] = asyncio.create_task(self._register_with(address, stop, know))

        for address in routers:
            know(address)
        await stop.wait()
        await asyncio.gather(*loops.values(), return_exceptions=True)

    async def _register_with(self, router: str, stop: asyncio.Event, know) -> None:
        """Register with the router process at `router`, and again whenever it does not watch this worker; `know`
        each process of that router its replies name, at the host this one was reached at."""
        host = router.rsplit(":", 1)[0]
        pace = RegistrationPace(self.watchers)
        async with aio_channel(router, self.tls, CHANNEL_OPTIONS) as channel:
            stub = control_pb2_grpc.MeshControlStub(channel)
            registered = False
            while not stop.is_set():
                try:
                    if pace.due():
                        reply = await stub.RegisterWorker(self.request, metadata=self._auth, timeout=2.0)
                        self.calls += 1
                        pace.registered(reply)
                        for port in reply.router_control_ports:
                            know(f"{host}:{port}")
                        if not registered:
                            log.info("registered with router", router=router)
                        registered = True
                except grpc.aio.AioRpcError as e:
                    pace.failed()
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # no retry can change that: stop, and say why
                        self.refused = (
                            f"the router at {router} refused this worker's mesh secret: give every process of the "
                            "mesh the same DELTAMESH_MESH_SECRET (or --mesh-secret-file)"
                        )
                        stop.set()
                        return
                    if registered:
                        log.warning("router unreachable", router=router, code=e.code().name)
                    registered = False
                try:
                    await asyncio.wait_for(stop.wait(), pace.interval_s)
                except TimeoutError:
                    pass

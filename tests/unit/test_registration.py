"""Registration and liveness on loopback gRPC, the router's registry and control plane against a worker's own report
stream and registration loop (no engine): a watched worker registers once, not at every heartbeat, and stays; one
whose stream ends registers again at once; a worker gone is dropped within MAX_MISSED_HEARTBEATS heartbeat intervals
of its last report, as it was of its last registration."""

import asyncio
import time

import grpc

from deltamesh.services.common.auth import mesh_interceptor
from deltamesh.services.common.registration import Registration
from deltamesh.services.common.reports import ReportSource, ReportsServicer, Watchers
from deltamesh.services.router.control import ControlServicer
from deltamesh.services.router.registry import MAX_MISSED_HEARTBEATS, WorkerRegistry
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc

SECRET = "s" * 32
# a report keep-alive every 0.2 s; dropped after 2 s unheard (ten keep-alives: a loaded machine's stalls pass)
HEALTH_S, HEARTBEAT_S = 0.05, 0.4
MARGIN_S = 2.0  # on upper bounds of wall-clock times: a loaded 2-core machine schedules the loop late


async def serve(add, servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=(mesh_interceptor(SECRET),))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class Router:
    """A router process's registry and control plane, tended as its main loop tends them."""

    async def start(self, port: int = 0) -> None:
        self.registry = WorkerRegistry(HEALTH_S, HEARTBEAT_S, SECRET)
        self.server = grpc.aio.server(interceptors=(mesh_interceptor(SECRET),))
        control_pb2_grpc.add_MeshControlServicer_to_server(ControlServicer(self.registry, "m", []), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        self.stop = asyncio.Event()
        self.tending = asyncio.create_task(self.registry.poll_forever(self.stop))

    async def close(self) -> None:
        self.stop.set()
        await self.tending
        await self.registry.close()
        await self.server.stop(None)


class Worker:
    """A worker's report stream and registration loop, as services/common/worker.py serves them."""

    async def start(self, router_port: int) -> None:
        self.watchers = Watchers()
        load = common_pb2.WorkerLoad(state_slots_total=4, kv_pages_total=100)
        reports = ReportsServicer(ReportSource(lambda: load, set), self.watchers)
        self.server, self.address = await serve(control_pb2_grpc.add_WorkerReportsServicer_to_server, reports)
        request = control_pb2.RegisterWorkerRequest(address=self.address, role="prefill", model="m")
        self.registration = Registration(request, SECRET, None, self.watchers)
        self.stop = asyncio.Event()
        self.loop = asyncio.create_task(self.registration.run([f"127.0.0.1:{router_port}"], self.stop))

    async def close(self) -> None:
        self.stop.set()
        await self.loop
        await self.server.stop(None)


async def until(condition, timeout: float = 10.0) -> float:
    """Seconds until `condition()` holds."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "not within the time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_a_watched_worker_registers_once_and_stays():
    async def run():
        router, worker = Router(), Worker()
        await router.start()
        await worker.start(router.port)
        try:
            await until(
                lambda: worker.address in router.registry.workers and worker.watchers.watching(router.registry.id)
            )
            calls = worker.registration.calls
            await asyncio.sleep(3 * MAX_MISSED_HEARTBEATS * HEARTBEAT_S)  # three times the bound a silent one has
            assert worker.registration.calls == calls <= 2  # before: a call every half heartbeat (30 more here)
            handle = router.registry.workers[worker.address]
            assert handle.healthy and time.monotonic() - handle.last_registered > MAX_MISSED_HEARTBEATS * HEARTBEAT_S
        finally:
            await worker.close()
            await router.close()

    asyncio.run(run())


def test_a_worker_registers_again_once_its_router_restarts():
    async def run():
        router, worker = Router(), Worker()
        await router.start()
        await worker.start(router.port)
        try:
            await until(
                lambda: router.registry.workers.get(worker.address) and worker.watchers.watching(router.registry.id)
            )
            port, first_id = router.port, router.registry.id
            await router.close()  # its streams end with it
            await until(lambda: not worker.watchers.watching(first_id))
            router = Router()
            await router.start(port)  # a new process on the same port: it knows no worker
            assert router.registry.id != first_id
            back = await until(
                lambda: router.registry.workers.get(worker.address) and router.registry.healthy("prefill")
            )
            assert back < HEARTBEAT_S + MARGIN_S  # at the worker's next look (each half heartbeat), not later
        finally:
            await worker.close()
            await router.close()

    asyncio.run(run())


def test_a_worker_gone_is_dropped_within_the_heartbeat_bound_of_its_last_report():
    async def run():
        router, worker = Router(), Worker()
        await router.start()
        await worker.start(router.port)
        try:
            await until(lambda: router.registry.healthy("prefill"))
            await asyncio.sleep(2 * MAX_MISSED_HEARTBEATS * HEARTBEAT_S)  # long past its registration
            handle = router.registry.workers[worker.address]
            await worker.close()  # the process gone: no report, no registration
            gone_at = time.monotonic()
            await until(lambda: worker.address not in router.registry.workers)
            dropped_after = time.monotonic() - max(handle.last_report, handle.last_registered)
            bound = MAX_MISSED_HEARTBEATS * HEARTBEAT_S
            assert bound <= dropped_after <= bound + MARGIN_S, dropped_after  # noticed at a tend after the bound
            assert time.monotonic() - gone_at <= bound + MARGIN_S
        finally:
            await router.close()

    asyncio.run(run())

"""What prefill and decode workers share: the engine, its compatibility hash, load reports, and
registration with the router (repeated as a heartbeat)."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import functools
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path

import grpc
import structlog

from deltamesh.engine import Engine, RequestError
from deltamesh.services.common.auth import mesh_interceptor, mesh_metadata
from deltamesh.services.common.convert import sampling_from_proto
from deltamesh.services.common.logs import bind_request, request_id_from, write_line
from deltamesh.services.common.server import CHANNEL_OPTIONS
from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.common.tls import aio_channel
from deltamesh.transfer import LeaseTable, Transport
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc

log = structlog.get_logger("deltamesh.worker")


class Role(abc.ABC):
    """What a worker role (prefill, decode) adds to the worker all roles share: its gRPC services, and its own start,
    stop and background work. The defaults do nothing."""

    leases: LeaseTable | None = None  # held states, exported in the worker's metrics

    @abc.abstractmethod
    def services(self) -> list[tuple]:
        """(add_servicer_to_server, servicer, service name) of each gRPC service, for GrpcServer."""

    async def on_start(self) -> None:
        pass

    async def on_stop(self) -> None:
        pass

    def background(self, stop: asyncio.Event) -> list[Coroutine]:
        """Coroutines that run while the worker serves; they end when `stop` is set."""
        return []


async def engine_request(engine, request, context, hold_state: bool = False):
    """The engine request of a Prefill/Decode call, with its id bound to the logs; INVALID_ARGUMENT for bad
    input, so nothing invalid reaches the engine loop. A request with structured outputs is made in a thread: its
    grammar is parsed then (xgrammar, imported by the first one), which would hold the event loop."""
    rid = request.request_id or request_id_from(context)
    if not rid:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
    bind_request(rid)
    try:
        params = sampling_from_proto(request.sampling, request.stop)
        make = functools.partial(engine.make_request, list(request.prompt_token_ids), params, rid, hold_state)
        return await asyncio.to_thread(make) if params.structured_outputs is not None else make()
    except (ValueError, RequestError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.engine = Engine(settings.engine)
        self.compat_hash = self.engine.compat_hash
        self.model_id = Path(settings.engine.model).name
        self.address = ""  # host:port once the gRPC server is bound
        self.reservations = 0
        self.failure: str | None = None  # why the engine stopped serving, once it did

    def load(self, leases: int = 0) -> common_pb2.WorkerLoad:
        l = self.engine.loads()  # noqa: E741
        return common_pb2.WorkerLoad(
            address=self.address,
            role=self.settings.role,
            running=l["running"],
            waiting=l["waiting"],
            held_states=l["held"],
            leases=leases,
            kv_pages_used=l["kv_pages_used"],
            kv_pages_total=l["kv_pages_total"],
            state_slots_used=l["state_slots_used"],
            state_slots_total=l["state_slots_total"],
            reservations=self.reservations,
            healthy=self.engine.failure is None,
            kv_pages_cached=l["kv_pages_cached"],
            prefix_cache_hit_tokens=l["prefix_cache_hit_tokens"],
            prefix_cache=self.engine.has_prefix_cache,
        )

    async def register_forever(self, stop: asyncio.Event) -> None:
        """Keep this worker registered with the router's control plane; survives router restarts."""
        router = self.settings.router
        if not router:
            return
        auth = mesh_metadata(self.settings.mesh_secret.get_secret_value())
        request = control_pb2.RegisterWorkerRequest(
            address=self.address,
            role=self.settings.role,
            model=self.model_id,
            compat_hash=self.compat_hash,
        )
        interval = 1.0
        async with aio_channel(router, self.settings.tls, CHANNEL_OPTIONS) as channel:
            stub = control_pb2_grpc.MeshControlStub(channel)
            registered = False
            while not stop.is_set():
                try:
                    reply = await stub.RegisterWorker(request, metadata=auth, timeout=2.0)
                    interval = max(reply.heartbeat_interval_ms / 1000 / 2, 0.05)
                    if not registered:
                        log.info("registered with router", router=router)
                    registered = True
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        log.error("the router refused this worker's mesh secret", router=router)
                    elif registered:
                        log.warning("router unreachable", router=router, code=e.code().name)
                    registered = False
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except TimeoutError:
                    pass

    async def stop_on_engine_failure(self, stop: asyncio.Event) -> None:
        """A tensor-parallel rank gone ends the engine (its requests end with the reason); the worker then stops,
        and exits with an error, so that the router drops it and a supervisor restarts it."""
        while not stop.is_set():
            if reason := self.engine.failure:
                log.error("engine failed; stopping the worker", reason=reason)
                self.failure = reason
                stop.set()
                return
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass

    def shutdown(self) -> None:
        self.engine.shutdown()


async def serve_worker(settings: WorkerSettings, stop: asyncio.Event, make_role: Callable[[Worker, Transport], Role]):
    """Start a worker: transport, engine, and the role `make_role(worker, transport)` with its gRPC services."""
    from deltamesh.engine.memory_budget import MemoryBudgetError
    from deltamesh.services.common.metrics import serve_worker_metrics
    from deltamesh.services.common.server import GrpcServer
    from deltamesh.services.supervisor import CONFIG_ERROR
    from deltamesh.transfer import open_transport

    transport = open_transport(settings.transport, settings)  # first: it may set up the process's environment
    if settings.role == "prefill":  # the worker that offers held states: read where its ranks hold them
        settings.engine = dataclasses.replace(settings.engine, rank_exporter=transport.rank_exporter)
    try:
        worker = Worker(settings)
    except MemoryBudgetError as e:  # its share of the GPU, measured once the weights are in: one line, no restart
        write_line(sys.stderr, f"deltamesh {settings.role}: {e}")
        raise SystemExit(CONFIG_ERROR) from None
    device = settings.engine.torch_device()
    if device.type == "cuda":
        import torch

        # the transport's CUDA copies are issued from this (the event loop's) thread; plain "cuda" is device 0 as in
        # torch
        torch.cuda.set_device(device.index or 0)
    role = make_role(worker, transport)
    serve_worker_metrics(worker, settings.host, settings.metrics_port, role.leases)
    await role.on_start()
    # only the router (and tools holding the mesh secret) may call a worker: its calls hand out leases' tokens
    server = GrpcServer(
        settings.host,
        settings.port,
        role.services(),
        settings.tls,
        interceptors=(mesh_interceptor(settings.mesh_secret.get_secret_value()),),
    )
    worker.address = f"{settings.advertise_host or settings.host}:{server.port}"
    await server.start()
    await server.set_serving(True)
    log.info(
        "worker serving",
        role=settings.role,
        address=server.address,
        model=worker.model_id,
        compat_hash=worker.compat_hash,
    )
    tasks = [
        asyncio.create_task(c)
        for c in [worker.register_forever(stop), worker.stop_on_engine_failure(stop), *role.background(stop)]
    ]
    write_line(sys.stdout, f"DELTAMESH_READY {settings.role} {server.address}")
    await stop.wait()
    log.info("worker stopping")
    await server.stop(grace_s=2.0)
    await asyncio.gather(*tasks, return_exceptions=True)
    await role.on_stop()
    transport.close()
    worker.shutdown()
    if worker.failure:
        raise SystemExit(1)

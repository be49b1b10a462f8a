"""What prefill and decode workers share: the engine, its compatibility hash, load reports, and
registration with the router (repeated while a router process does not watch the worker: registration.py)."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import functools
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

from deltamesh.engine import Engine, RequestError
from deltamesh.engine.gc_pauses import freeze_startup_heap
from deltamesh.services.common.auth import mesh_interceptor
from deltamesh.services.common.convert import sampling_from_proto
from deltamesh.services.common.logs import bind_request, request_id_from, write_line
from deltamesh.services.common.registration import Registration
from deltamesh.services.common.reports import ReportSource, ReportsServicer, Watchers
from deltamesh.services.common.settings import WorkerSettings
from deltamesh.services.supervisor import CONFIG_ERROR
from deltamesh.transfer import LeaseTable, Transport
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc

if TYPE_CHECKING:  # state_exchange imports this module
    from deltamesh.services.common.state_exchange import HolderSide

log = structlog.get_logger("deltamesh.worker")


class Role(abc.ABC):
    """What a worker role (prefill, decode) adds to the worker all roles share: its gRPC services, and its own start,
    stop and background work. The defaults do nothing."""

    leases: LeaseTable | None = None  # held states, exported in the worker's metrics
    holding: HolderSide | None = None  # its side of holding states for pullers: its description goes to the routers

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


def router_addresses(routers: str | None) -> list[str]:
    """The control-plane addresses in --router: one, or several comma-separated (several router hosts)."""
    return [a.strip() for a in (routers or "").split(",") if a.strip()]


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.engine = Engine(settings.engine)
        self.compat_hash = self.engine.compat_hash
        self.model_id = Path(settings.engine.model).name
        self.served_name = (settings.served_model_name or [self.model_id])[0]  # what vLLM's metric names label
        self.address = ""  # host:port once the gRPC server is bound
        self.reservations = 0
        self.failure: str | None = None  # why the engine stopped serving, once it did
        self.refused: str | None = None  # why the router will not take this worker, once it said so
        self.watchers = Watchers()  # the router processes watching it: it registers again with those that stop

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
        """Keep this worker registered with every router it knows of (registration.py); a router refusing its mesh
        secret stops it (`refused` says why)."""
        request = control_pb2.RegisterWorkerRequest(
            address=self.address,
            role=self.settings.role,
            model=self.model_id,
            compat_hash=self.compat_hash,
        )
        secret = self.settings.mesh_secret.get_secret_value()
        registration = Registration(request, secret, self.settings.tls, self.watchers)
        await registration.run(router_addresses(self.settings.router), stop)
        self.refused = registration.refused

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

    def prefix_keys(self) -> set[int]:
        """The cached prefixes a request can resume after, as the routers name prompts (none without a cache)."""
        return self.engine.prefix_resume_keys()

    def shutdown(self) -> None:
        self.engine.shutdown()


async def serve_worker(settings: WorkerSettings, stop: asyncio.Event, make_role: Callable[[Worker, Transport], Role]):
    """Start a worker: transport, engine, and the role `make_role(worker, transport)` with its gRPC services."""
    from deltamesh.engine.memory_budget import MemoryBudgetError
    from deltamesh.services.common.metrics import serve_worker_metrics
    from deltamesh.services.common.server import GrpcServer
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
    # what the routers watching this worker learn: its load (as GetLoads gives it) and its cache's prefixes
    reports = ReportsServicer(
        ReportSource(
            lambda: worker.load(len(role.leases) if role.leases is not None else 0),
            worker.prefix_keys,
            lambda: role.holding.description if role.holding is not None else None,
        ),
        worker.watchers,
    )
    reports_name = control_pb2.DESCRIPTOR.services_by_name["WorkerReports"].full_name
    # only the router (and tools holding the mesh secret) may call a worker: its calls hand out leases' tokens
    server = GrpcServer(
        settings.host,
        settings.port,
        [*role.services(), (control_pb2_grpc.add_WorkerReportsServicer_to_server, reports, reports_name)],
        settings.tls,
        interceptors=(mesh_interceptor(settings.mesh_secret.get_secret_value()),),
    )
    worker.address = f"{settings.advertise_host or settings.host}:{server.port}"
    await server.start()
    # the model and its kernels are built and warmed up; the collection runs before health says SERVING, so that
    # no router sends a request into it
    frozen = freeze_startup_heap()
    await server.set_serving(True)
    log.info(
        "worker serving",
        role=settings.role,
        address=server.address,
        model=worker.model_id,
        compat_hash=worker.compat_hash,
        gc_frozen_objects=frozen.objects,
        gc_freeze_collect_ms=frozen.collect_ms,
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
    if worker.refused:  # a configuration no restart mends (supervisor.CONFIG_ERROR)
        write_line(sys.stderr, f"deltamesh {settings.role}: {worker.refused}")
        raise SystemExit(CONFIG_ERROR)
    if worker.failure:
        raise SystemExit(1)

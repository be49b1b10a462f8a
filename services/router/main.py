"""Router process: gRPC front door (+ the REST gateway when an HTTP port is set)."""

from __future__ import annotations

import asyncio

import structlog

from deltamesh.v1 import router_pb2, router_pb2_grpc
from services.common.server import GrpcServer
from services.common.settings import RouterSettings
from services.router.frontend import Frontend
from services.router.gateway import Gateway, start_gateway
from services.router.mesh import Mesh
from services.router.metrics import register_worker_gauge
from services.router.policies import POLICIES
from services.router.registry import WorkerRegistry
from services.router.servicer import RouterServicer

log = structlog.get_logger("deltamesh.router")


async def serve(settings: RouterSettings, stop: asyncio.Event) -> None:
    frontend = Frontend(settings.model, settings.max_model_len, settings.limits)
    registry = WorkerRegistry(settings.health_interval_s, settings.heartbeat_interval_s, settings.tls)
    for role in ("prefill", "decode", "colocated"):
        for address in getattr(settings, role):
            registry.add(address, role, static=True)
    register_worker_gauge(registry)
    mesh = Mesh(registry, POLICIES[settings.policy](), settings.prefill_retries, settings.request_timeout_s)
    servicer = RouterServicer(frontend, mesh, registry)
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    services = [(router_pb2_grpc.add_RouterServicer_to_server, servicer, name)]
    server = GrpcServer(settings.host, settings.grpc_port, services, settings.tls)
    await server.start()
    await server.set_serving(True)
    tasks = [asyncio.create_task(registry.poll_forever(stop))]
    http = None
    if settings.http_port:
        http, http_task = await start_gateway(Gateway(frontend, mesh, settings.api_key), settings.host, settings.http_port,
                                              settings.http_header_timeout_s)  # fmt: skip
        tasks.append(http_task)
    log.info("router serving", grpc=server.address, http=settings.http_port, model=frontend.model_id,
             policy=settings.policy)  # fmt: skip
    print(f"DELTAMESH_READY router {server.address}", flush=True)
    await stop.wait()
    if http is not None:
        http.should_exit = True
    await server.stop(grace_s=2.0)
    await asyncio.gather(*tasks, return_exceptions=True)
    await registry.close()
    frontend.close()

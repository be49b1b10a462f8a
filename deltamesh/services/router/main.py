"""Router process: gRPC front door (+ the REST gateway when an HTTP port is set)."""

from __future__ import annotations

import asyncio
import logging
import sys

import structlog

from deltamesh.engine.gc_pauses import freeze_startup_heap
from deltamesh.services.common.auth import api_key_interceptor, mesh_interceptor
from deltamesh.services.common.logs import write_line
from deltamesh.services.common.server import GrpcServer
from deltamesh.services.common.settings import RouterSettings, chat_template_defaults
from deltamesh.services.router.admission import AdmissionLimits
from deltamesh.services.router.chat_output import OutputFormat
from deltamesh.services.router.control import ControlServicer
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.gateway import Gateway, start_gateway
from deltamesh.services.router.limits import MAX_REQUEST_BYTES
from deltamesh.services.router.mesh import Mesh
from deltamesh.services.router.metrics import register_worker_gauge
from deltamesh.services.router.pd_decider import PdDecider
from deltamesh.services.router.policies import make_policy
from deltamesh.services.router.processes import control_ports, learn_from_siblings, own_control_port
from deltamesh.services.router.registry import WorkerRegistry
from deltamesh.services.router.servicer import RouterServicer
from deltamesh.services.router.shared_counts import SharedCounts
from deltamesh.v1 import control_pb2, control_pb2_grpc, router_pb2, router_pb2_grpc

log = structlog.get_logger("deltamesh.router")
# --uvicorn-log-level's names (uvicorn's own trace level is 5)
UVICORN_LEVELS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10, "trace": 5}


async def serve(settings: RouterSettings, stop: asyncio.Event) -> None:
    """One router process: with --api-server-count N, one of N sharing the client ports (router/processes.py)."""
    frontend = Frontend(
        settings.model,
        settings.max_model_len,
        settings.limits,
        settings.served_model_name,
        settings.chat_template,
        settings.generation_config,
        settings.generation_overrides(),
        chat_template_defaults(settings.default_chat_template_kwargs),
        settings.max_logprobs,
    )
    # uvicorn logs through the standard library, whose root logger passes warnings up (logs.configure_logging)
    logging.getLogger("uvicorn").setLevel(UVICORN_LEVELS[settings.uvicorn_log_level])
    secret = settings.mesh_secret.get_secret_value()
    shared = settings.api_server_count > 1
    registry = WorkerRegistry(settings.health_interval_s, settings.heartbeat_interval_s, secret, settings.tls)
    for role in ("prefill", "decode", "colocated"):
        for address in getattr(settings, role):
            registry.add(address, role, static=True)
    register_worker_gauge(registry)
    pd = (
        PdDecider(settings.pd_direct_max_tokens, settings.page_size, index=registry.index)
        if settings.pd_direct_max_tokens
        else None
    )
    policy = make_policy(settings.policy, settings.page_size, registry.index)
    counts = None  # the admissions of every process of this router, in memory they share (router/processes.py)
    if shared and settings.shared_counts_fd is not None:
        counts = SharedCounts(settings.shared_counts_fd, settings.api_server_count, settings.process_index or 0)
    admission = AdmissionLimits(settings.max_queued_requests, settings.page_size, frontend.max_model_len, counts)
    mesh = Mesh(
        registry,
        policy,
        settings.prefill_retries,
        settings.request_timeout_s,
        settings.ready_timeout_s,
        pd,
        admission,
        log_requests=settings.log_requests,
    )
    template = frontend.tokenizer.chat_template if frontend.tokenizer else None
    output_format = OutputFormat.resolve(template, settings.reasoning_parser, settings.tool_call_parser)
    # Two listeners: the client API (the API key, when set) and the control plane (the mesh secret)
    name = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    client_api = [(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(frontend, mesh, output_format), name)]
    key_check = (api_key_interceptor(settings.api_key),) if settings.api_key else ()
    server = GrpcServer(
        settings.host,
        settings.grpc_port,
        client_api,
        settings.tls,
        interceptors=key_check,
        max_request_bytes=MAX_REQUEST_BYTES,  # REST's body cap: one limit on both edges
        reuse_port=shared,
    )
    name = control_pb2.DESCRIPTOR.services_by_name["MeshControl"].full_name
    control_servicer = ControlServicer(registry, frontend.checkpoint_name, control_ports(settings))
    control_api = [(control_pb2_grpc.add_MeshControlServicer_to_server, control_servicer, name)]
    control = GrpcServer(
        settings.host,
        own_control_port(settings),
        control_api,
        settings.tls,
        interceptors=(mesh_interceptor(secret),),
    )
    for s in (server, control):
        await s.start()
        await s.set_serving(True)
    if shared:
        await learn_from_siblings(settings, registry)
    tasks = [asyncio.create_task(registry.poll_forever(stop))]
    http = None
    if settings.http_port:
        gateway = Gateway(
            frontend,
            mesh,
            settings.api_key,
            settings.http_body_timeout_s,
            output_format,
            process=settings.process_index if shared else None,
        )
        http, http_task = await start_gateway(
            gateway, settings.host, settings.http_port, settings.http_header_timeout_s, reuse_port=shared
        )
        tasks.append(http_task)
    frozen = freeze_startup_heap()  # what lives as long as the router: modules, the tokenizer, the app
    log.info(
        "router serving",
        grpc=server.address,
        control=control.address,
        http=settings.http_port,
        model=frontend.served_model_names,
        policy=settings.policy,
        process=f"{settings.process_index} of {settings.api_server_count}" if shared else None,
        reasoning_parser=output_format.reasoning,
        tool_call_parser=output_format.tool_calls,
        gc_frozen_objects=frozen.objects,
        gc_freeze_collect_ms=frozen.collect_ms,
    )
    write_line(sys.stdout, f"DELTAMESH_READY router {server.address}")
    await stop.wait()
    if http is not None:
        http.should_exit = True
    await asyncio.gather(server.stop(grace_s=2.0), control.stop(grace_s=0.5))
    await asyncio.gather(*tasks, return_exceptions=True)
    await mesh.legs.feeds.close()  # the token feeds' readers (the channels' closing would end them too)
    await registry.close()
    frontend.close()

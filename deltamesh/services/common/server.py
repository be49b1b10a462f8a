"""gRPC server plumbing shared by every service: grpc.aio on uvloop, the standard health service and
server reflection, loopback by default, graceful shutdown on SIGINT/SIGTERM/SIGHUP."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
import structlog
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deltamesh.services.common.logs import write_line
from deltamesh.services.supervisor import exit_without_teardown

log = structlog.get_logger("deltamesh.server")

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
# so_reuseport off: a second server on a taken port must fail loudly, not share its traffic.
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 5_000), ("grpc.so_reuseport", 0)]


class GrpcServer:
    """A started grpc.aio server with health (per service name and overall) and reflection."""

    def __init__(
        self,
        host: str,
        port: int,
        services: Sequence[tuple[Callable, object, str]],
        tls=None,
        interceptors: tuple = (),
        max_request_bytes: int = MAX_MESSAGE_BYTES,
        reuse_port: bool = False,
    ):
        """`services`: (add_XServicer_to_server, servicer, full service name); `tls`: TlsSettings or None;
        `interceptors`: e.g. deltamesh.services.common.auth's, which refuse calls without credentials;
        `max_request_bytes`: the largest request message taken (larger: RESOURCE_EXHAUSTED, unread); `reuse_port`:
        share the port with other processes of this user that bind it so (router/processes.py)."""
        options = [o for o in SERVER_OPTIONS if o[0] not in ("grpc.max_receive_message_length", "grpc.so_reuseport")]
        options += [("grpc.max_receive_message_length", max_request_bytes), ("grpc.so_reuseport", int(reuse_port))]
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self.health = health_async.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for add, servicer, _ in services:
            add(servicer, self.server)
        self.names = [name for *_, name in services]
        reflection.enable_server_reflection(
            self.names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        if tls is not None and tls.enabled:
            from deltamesh.services.common.tls import server_credentials

            self.port = self.server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC on {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


# A graceful stop that has not ended by then ends the process: under `deltamesh serve` its supervisor kills it sooner
# (supervisor.STOP_DEADLINE_S), but a process whose serve died, or that runs alone, has no one else to.
STOP_DEADLINE_S = 30.0


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop_event)` on uvloop; SIGINT/SIGTERM/SIGHUP set the event so `main` can shut down cleanly
    (SIGHUP: the terminal closed, or the kernel waking a stopped child of a `serve` that died: supervisor.py),
    within STOP_DEADLINE_S."""
    import uvloop

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if not stop.is_set():
                stop.set()
                threading.Thread(target=_exit_after, args=(STOP_DEADLINE_S,), daemon=True).start()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, on_signal)
        await main(stop)

    uvloop.run(runner())
    exit_without_teardown(0)  # everything it owns is closed: the interpreter's teardown only costs seconds


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    write_line(sys.stderr, f"deltamesh: still stopping {seconds:g} s after the signal to stop; exiting now")
    os._exit(1)

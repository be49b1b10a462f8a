"""A router of several processes (--api-server-count N): one parent starts N router processes and starts again any
that dies, while the others serve (supervisor.py; `deltamesh serve` does the same for its router's processes).

The client ports are shared. Every process binds the gRPC and REST ports with SO_REUSEPORT, and the kernel spreads
incoming connections over them; each connection stays with the process that accepted it, so nothing sits between a
client and the process that serves it, and a process that dies takes only its own connections (and those waiting in
its accept queue, which are reset: clients retry them). The other way, one acceptor handing each connection's socket
to a child, puts that acceptor back in front of every connection and cannot hand a socket to gRPC's server, which
accepts only on ports it binds itself. The kernel shares a port only among processes of the same user, who could do
anything to the router anyway; the parent checks the ports free before it starts the processes, so a port another
program holds still stops the router at once. Connections, not requests, are spread: one client on one gRPC channel
(one connection) reaches one process.

The control plane is not shared: process i listens on --control-port + i. Workers register with each process (every
registration reply names them all: services/common/worker.py), and each process watches each worker itself
(registry.py), so every process has the whole mesh's loads and cached prefixes and none depends on another. A process
started again asks its siblings which workers they know, so that it serves with their view at once instead of
waiting for the workers' next registrations.

Admission (admission.py) counts the room each process's requests hold on each decode worker in memory the processes
share (shared_counts.py), so that N processes never admit more than one would. Each process keeps its own queue
(--max-queued-requests each, first come first served within it), and takes a sibling's released room in at the
worker's next report."""

from __future__ import annotations

import os
import sys

import grpc
import structlog

from deltamesh.services.common.auth import mesh_metadata
from deltamesh.services.common.options import hand_over
from deltamesh.services.common.server import CHANNEL_OPTIONS
from deltamesh.services.common.settings import RouterSettings
from deltamesh.services.common.tls import aio_channel
from deltamesh.services.router import shared_counts
from deltamesh.services.router.registry import WorkerRegistry
from deltamesh.services.supervisor import ChildSpec
from deltamesh.v1 import common_pb2, control_pb2_grpc

log = structlog.get_logger("deltamesh.router")


def control_ports(settings: RouterSettings) -> list[int]:
    """The control-plane port of each of the router's processes."""
    return [settings.control_port + i for i in range(settings.api_server_count)]


def own_control_port(settings: RouterSettings) -> int:
    return settings.control_port + (settings.process_index or 0)


def router_ports(settings: RouterSettings) -> dict[str, int | None]:
    """Every port the router's processes listen on, by the flag that sets it (for a check that they are free)."""
    ports: dict[str, int | None] = {"--grpc-port": settings.grpc_port}
    for i, port in enumerate(control_ports(settings)):
        ports["--control-port" + (f" + {i}" if i else "")] = port
    return ports | {"--http-port": settings.http_port}


def router_specs(settings: RouterSettings, env: dict[str, str], name: str = "router") -> list[ChildSpec]:
    """The N router processes' specs: each handed `settings` with its number and the shared counts' descriptor (made
    here, inherited by each), `env` besides (the mesh secret and API key travel there)."""
    fd = shared_counts.create(settings.api_server_count)
    os.set_inheritable(fd, True)
    cli = [sys.executable, "-m", "deltamesh.services.cli", "router"]
    return [
        ChildSpec(
            f"{name}-{i}",
            cli,
            {**env, **hand_over(settings.model_copy(update={"process_index": i, "shared_counts_fd": fd}))},
            pass_fds=(fd,),
        )
        for i in range(settings.api_server_count)
    ]


async def learn_from_siblings(settings: RouterSettings, registry: WorkerRegistry) -> int:
    """Add the workers the router's other processes know (each registers with this one too, but only once it finds
    that no stream of this process watches it: services/common/registration.py); how many were added."""
    own = own_control_port(settings)
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "") else "::1" if settings.host == "::" else settings.host
    added = 0
    for port in control_ports(settings):
        if port == own:
            continue
        try:
            async with aio_channel(f"{host}:{port}", settings.tls, CHANNEL_OPTIONS) as channel:
                reply = await control_pb2_grpc.MeshControlStub(channel).GetLoads(
                    common_pb2.GetLoadsRequest(),
                    metadata=mesh_metadata(settings.mesh_secret.get_secret_value()),
                    timeout=2,
                )
        except grpc.aio.AioRpcError:
            continue  # not up (yet): the workers register with this process themselves
        for load in reply.workers:
            if load.address not in registry.workers:
                registry.add(load.address, load.role, static=False)
                added += 1
    if added:
        log.info("workers learned from the router's other processes", workers=added)
    return added


def run_router_processes(settings: RouterSettings, env: dict[str, str]) -> int:
    """Start the N router processes and keep them running until SIGINT/SIGTERM (supervisor.py); its exit code."""
    from deltamesh.services.supervisor import Supervisor

    return Supervisor(router_specs(settings, env)).run()

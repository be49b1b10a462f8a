"""uvicorn embedded in the router process, serving the gateway's app with a deadline on request heads."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from deltamesh.services.router.gateway.app import create_app
from deltamesh.services.router.gateway.dependencies import Gateway


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the router process, which owns signal handling."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving a request's line and headers. uvicorn closes idle
    keep-alive connections but has no such deadline: a client that connects and sends nothing, or half a
    request line, would hold its connection (and a file descriptor) for ever. The deadline starts when the
    connection opens or a new request's first bytes arrive, and ends with the request's head."""

    header_timeout_s = 10.0  # set per server by start_gateway

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # (re)start: these bytes begin a request
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's head is in
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes of this user may bind too (SO_REUSEPORT): the kernel
    spreads the connections over them (router/processes.py)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def start_gateway(
    gateway: Gateway, host: str, port: int, header_timeout_s: float = 10.0, reuse_port: bool = False
) -> tuple[_EmbeddedServer, asyncio.Task]:
    """uvicorn serving the gateway on host:port (with `reuse_port`, on a port shared with other processes)."""
    protocol = type("HeaderDeadline", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(
        create_app(gateway),
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
        http=protocol,
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[shared_socket(host, port)] if reuse_port else None))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # re-raise a bind failure
        raise OSError(f"REST gateway could not start on {host}:{port}")
    return server, task

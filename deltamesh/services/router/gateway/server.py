"""uvicorn embedded in the router process, serving the gateway's app with a deadline on request heads."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from deltamesh.services.router.gateway.app import create_app
from deltamesh.services.router.gateway.dependencies import Gateway


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the router process, which owns signal handling."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol (a C parser, cheaper per streamed SSE event than h11: bench/RESULTS.md) with two
    bounds on a request's line and headers that uvicorn lacks: a deadline, and a size.
    uvicorn closes idle keep-alive connections, but a client that connects and sends nothing, or half a request
    line, would hold its connection (and a file descriptor) for ever, and llhttp keeps headers of any size (h11 stopped
    at 16 KiB). The deadline starts when the connection opens or a new request's first bytes arrive, and ends with the
    request's head; the head's bytes are counted over the same span."""

    header_timeout_s = 10.0  # set per server by start_gateway
    max_head_bytes = 64 << 10

    def connection_made(self, transport) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # its callbacks disarm the deadline when the head is complete in `data`
        if self._deadline is not None and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._disarm()
                self.send_400_response("Request line and headers too large.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._head_bytes = 0
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
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

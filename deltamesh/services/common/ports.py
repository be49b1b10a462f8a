"""Choose a loopback or host port that a process will bind later, and check, before anything starts, that the
ports a command will listen on can be bound."""

from __future__ import annotations

import os
import random
import socket


class ListenProblem(ValueError):
    """A host or port a command cannot listen on, in words naming the flag to change."""


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> int:
    """A free port below the ephemeral range, none of `avoid` (ports another process of the mesh binds later).
    The port is bound later, often by another process; a port from the ephemeral range (bind to port 0) can be
    taken in between by any process's next outgoing connection or port-0 listener (UCX's included), seen in
    practice as 'Address already in use'."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10000, low)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} below {low}")


def check_listeners(host: str, ports: dict[str, int | None]) -> None:
    """Raise ListenProblem unless every port of `ports` ({what names it: port}; 0 or None: chosen later or off)
    can be listened on at `host`: a host this machine has, no port given twice, none taken. Checked before a
    model loads, not found by a server's traceback after it."""
    given: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:  # chosen later or off: no clash
            continue
        if port in given:
            raise ListenProblem(f"{given[port]} and {flag} are both port {port}: every port must differ")
        given[port] = flag
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        socket.create_server((host, 0)).close()
    except OSError as e:  # socket.gaierror: no such name or address; otherwise not an address of this host
        raise ListenProblem(f"cannot listen on --host {host}: {_reason(e)}") from None
    for flag, port in ports.items():
        if not port:
            continue
        try:
            socket.create_server((host, port)).close()  # SO_REUSEADDR as the servers bind: TIME_WAIT is no clash
        except OSError as e:
            raise ListenProblem(f"cannot listen on {host}:{port} ({flag}): {_reason(e)}") from None


def _reason(e: OSError) -> str:
    """The error in words, without the address socket.create_server adds (the message names it already)."""
    if isinstance(e, socket.gaierror) or e.errno is None:
        return e.strerror or str(e)
    return os.strerror(e.errno)

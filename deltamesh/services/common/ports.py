"""Choose a loopback or host port that a process will bind later."""

from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A free port below the ephemeral range. The port is bound later, often by another process; a port from the
    ephemeral range (bind to port 0) can be taken in between by any process's next outgoing connection or port-0
    listener (UCX's included), seen in practice as 'Address already in use'."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} below {low}")

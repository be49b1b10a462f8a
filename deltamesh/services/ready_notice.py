"""`deltamesh serve`'s one line for the user once the mesh can serve: every worker it started has registered with
the router and is healthy. Read from the router's control plane in a background thread, so that nothing waits on
it; a mesh that never gets ready says nothing more here (the supervisor reports exits)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter

import grpc

from deltamesh.services.common.logs import write_line
from deltamesh.services.common.tls import TlsSettings, channel_credentials


def announce_when_ready(
    controls: list[str], secret: str, roles: Counter, tls: TlsSettings, where: str, timeout_s: float = 3600.0
) -> threading.Thread:
    """Print "deltamesh: mesh ready ..." once every process of the router (at `controls`, their control planes)
    sees `roles` healthy workers."""

    def sees_all(control: str, credentials) -> bool:
        from deltamesh.services.router.control import read_loads

        try:
            healthy = Counter(w.role for w in read_loads(control, secret, credentials, timeout=2) if w.healthy)
        except grpc.RpcError:
            return False
        return all(healthy[role] >= n for role, n in roles.items())

    def watch() -> None:
        credentials = channel_credentials(tls) if tls.cert else None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(sees_all(control, credentials) for control in controls):
                counts = " + ".join(f"{n} {role}" for role, n in roles.items())
                write_line(sys.stderr, f"deltamesh: mesh ready ({counts}): {where}")
                return
            time.sleep(0.5)

    thread = threading.Thread(target=watch, name="ready-notice", daemon=True)
    thread.start()
    return thread

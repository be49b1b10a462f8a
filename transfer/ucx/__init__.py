"""The UCX transport (ucxx + UCX RMA): one-sided pulls of leased state, see transfer/ucx/puller.py."""

from __future__ import annotations

import ipaddress
import os

from transfer.ucx import loop_worker


def configure_ucx(bind_host: str) -> None:
    """Must run before the UCX worker is created: when the side channel is bound to loopback, UCX may use
    only `lo` (by default it would open every network device it finds)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if _is_loopback(bind_host):
        os.environ["UCX_NET_DEVICES"] = "lo"


def shutdown_ucx() -> None:
    """Release this process's UCX worker once the side channel's endpoints are closed, so that another event
    loop (tests) can create a new one."""
    loop_worker.close()


def worker_address() -> bytes:
    """This process's UCX worker address (what peers connect to); starts UCX on first use."""
    return loop_worker.get().address


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

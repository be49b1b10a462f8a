"""The UCX transport (ucxx + UCX RMA): one-sided pulls of leased state (deltamesh/transfer/ucx/puller.py), its descriptors
(deltamesh/transfer/ucx/descriptors.py, protos/deltamesh/v1/ucx.proto)."""

from __future__ import annotations

import ipaddress
import os

from deltamesh.transfer.base import Transport
from deltamesh.transfer.leases import LeaseTable
from deltamesh.transfer.ucx import descriptors, loop_worker
from deltamesh.transfer.ucx.holder import UcxHolder
from deltamesh.transfer.ucx.puller import UcxPuller


class UcxTransport(Transport):
    kind, version = descriptors.KIND, descriptors.VERSION
    rank_exporter = "deltamesh.transfer.ucx.rank_memory:export"

    def __init__(self, bind_host: str = "127.0.0.1", error_handling: bool = True, spin_s: float = 0.02):
        """Made before UCX starts in this process (its settings are read then): when the worker is bound to
        loopback, UCX may use only `lo` (by default it would open every network device it finds).
        `error_handling`, `spin_s`: see UcxPuller."""
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        if _is_loopback(bind_host):
            os.environ["UCX_NET_DEVICES"] = "lo"
        self.error_handling, self.spin_s = error_handling, spin_s

    @classmethod
    def from_settings(cls, settings) -> UcxTransport:
        return cls(settings.host, settings.ucx_error_handling)

    def holder(self, leases: LeaseTable) -> UcxHolder:
        return UcxHolder(leases)

    def puller(self, settle_grace_s: float = 10.0) -> UcxPuller:
        return UcxPuller(self.error_handling, settle_grace_s, self.spin_s)

    def close(self) -> None:
        """Release this process's UCX worker, so that another event loop (tests) can create a new one."""
        loop_worker.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""State transfer between workers: leases on held state, and the UCX transport that pulls it.
It moves lists of byte buffers and knows nothing of models."""

from transfer.base import TransferError, TransferStats, segments
from transfer.leases import Lease, LeaseRefused, LeaseTable
from transfer.ucx import configure_ucx, shutdown_ucx, worker_address
from transfer.ucx.descriptors import LeaseCheck, RemoteRegion
from transfer.ucx.holder import StateServer
from transfer.ucx.puller import StatePuller

__all__ = [
    "Lease",
    "LeaseCheck",
    "LeaseRefused",
    "LeaseTable",
    "RemoteRegion",
    "StatePuller",
    "StateServer",
    "TransferError",
    "TransferStats",
    "configure_ucx",
    "shutdown_ucx",
    "segments",
    "worker_address",
]

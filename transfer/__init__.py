"""The UCX side channel: leases on held state, and the pull protocol between prefill and decode workers.
It moves lists of byte buffers and knows nothing of models."""

from transfer.leases import Lease, LeaseRefused, LeaseTable
from transfer.side_channel import (
    LeaseCheck,
    RemoteRegion,
    StatePuller,
    StateServer,
    TransferError,
    TransferStats,
    configure_ucx,
    shutdown_ucx,
    segments,
    worker_address,
)

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

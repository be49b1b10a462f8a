"""State transfer between workers: leases on held state (transfer/leases.py), the interface every transport
implements (transfer/base.py) and the transports (transfer/registry.py; UCX in transfer/ucx/). It moves lists
of byte buffers and knows nothing of models."""

from transfer.base import (
    DescriptorError,
    LeaseKey,
    Source,
    StateHolder,
    StatePuller,
    TransferError,
    TransferStats,
    Transport,
    segments,
)
from transfer.leases import MIN_TOKEN_BYTES, Lease, LeaseRefused, LeaseTable
from transfer.registry import TRANSPORTS, open_transport

__all__ = [
    "MIN_TOKEN_BYTES",
    "TRANSPORTS",
    "DescriptorError",
    "Lease",
    "LeaseKey",
    "LeaseRefused",
    "LeaseTable",
    "Source",
    "StateHolder",
    "StatePuller",
    "TransferError",
    "TransferStats",
    "Transport",
    "open_transport",
    "segments",
]

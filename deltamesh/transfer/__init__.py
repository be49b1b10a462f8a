"""State transfer between workers: leases on held state (deltamesh/transfer/leases.py), the interface every transport
implements (deltamesh/transfer/base.py) and the transports (deltamesh/transfer/registry.py; UCX in deltamesh/transfer/ucx/). It moves lists
of byte buffers and knows nothing of models."""

from deltamesh.transfer.base import (
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
from deltamesh.transfer.leases import MIN_TOKEN_BYTES, Lease, LeaseRefused, LeaseTable
from deltamesh.transfer.registry import TRANSPORTS, open_transport

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

"""The transports a worker can choose (`--transport`), by name."""

from __future__ import annotations

from deltamesh.transfer.base import Transport
from deltamesh.transfer.ucx import UcxTransport

TRANSPORTS: dict[str, type[Transport]] = {UcxTransport.kind: UcxTransport}


def open_transport(name: str, settings) -> Transport:
    """The transport `name` for a worker with these WorkerSettings; ValueError for an unknown name."""
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise ValueError(f"unknown transport {name!r}; transports: {', '.join(TRANSPORTS)}")
    return cls.from_settings(settings)

"""What a UCX puller is told of held state: where each region is and the key to read it, and where the lease's
word is."""

from __future__ import annotations

from dataclasses import dataclass

from transfer.leases import lease_nonce


@dataclass(frozen=True)
class RemoteRegion:
    """One held region as a puller reads it: its size, where it starts in the holder's memory, and the
    packed UCX remote key of the registered memory around it."""

    nbytes: int
    address: int
    rkey: bytes


@dataclass(frozen=True)
class LeaseCheck:
    """Where a lease's word is in the holder's memory (registered host memory, and its packed remote key), and
    the nonce it holds while the lease lives."""

    address: int
    rkey: bytes
    nonce: int

    @classmethod
    def of(cls, address: int, rkey: bytes, token: bytes, lease_id: str, regions: list[RemoteRegion]) -> "LeaseCheck":
        """The check of a pull of `regions` under lease `lease_id` with `token`: what the word must hold."""
        return cls(address, rkey, lease_nonce(token, lease_id, [(r.address, r.nbytes) for r in regions]))

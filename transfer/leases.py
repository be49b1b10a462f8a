"""Leases: a prefill worker's promise to hold one request's state for a while, redeemable once.

A lease has an id (public), a secret token (given to whoever may pull the state), a compatibility hash and
an expiry. It ends exactly once: pulled, released, expired or aborted; its `on_end` callback then frees the
held memory. The side channel refuses unknown, expired, already-used and wrong-token pulls.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch


class LeaseRefused(Exception):
    """The lease cannot be redeemed; the message says why (safe to show the puller)."""


@dataclass
class Lease:
    lease_id: str
    token: bytes
    compat_hash: str
    buffers: list[torch.Tensor]  # 1-D uint8 views of the held memory, in order
    expires_at: float  # time.monotonic()
    on_end: Callable[[str], None]  # called once with the reason: pulled | released | expired | aborted

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def expires_unix_ms(self) -> int:
        return int((time.time() + self.expires_at - time.monotonic()) * 1000)


class LeaseTable:
    def __init__(self):
        self._leases: dict[str, Lease] = {}
        self._in_transfer: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.counts = {"pulled": 0, "released": 0, "expired": 0, "aborted": 0, "refused": 0}

    def offer(self, lease_id: str, compat_hash: str, buffers: list[torch.Tensor], ttl_s: float,
              on_end: Callable[[str], None]) -> Lease:  # fmt: skip
        lease = Lease(lease_id, secrets.token_bytes(16), compat_hash, buffers, time.monotonic() + ttl_s, on_end)
        with self._lock:
            if lease_id in self._leases or lease_id in self._in_transfer:
                raise ValueError(f"lease {lease_id!r} already exists")
            self._leases[lease_id] = lease
        return lease

    def _check(self, lease_id: str, token: bytes) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            used = lease_id in self._in_transfer
            raise LeaseRefused(f"lease {lease_id!r} is {'already being pulled' if used else 'unknown or ended'}")
        if not hmac.compare_digest(lease.token, token):
            raise LeaseRefused(f"wrong token for lease {lease_id!r}")
        if time.monotonic() >= lease.expires_at:
            raise LeaseRefused(f"lease {lease_id!r} has expired")
        return lease

    def take(self, lease_id: str, token: bytes, compat_hash: str) -> Lease:
        """Start a pull: the lease can no longer be pulled, released or expire until `finish_pull`."""
        with self._lock:
            try:
                lease = self._check(lease_id, token)
                if compat_hash != lease.compat_hash:
                    raise LeaseRefused(
                        f"incompatible state layout: puller has {compat_hash}, holder has {lease.compat_hash}"
                    )
            except LeaseRefused:
                self.counts["refused"] += 1
                raise
            del self._leases[lease_id]
            self._in_transfer[lease_id] = lease
        return lease

    def finish_pull(self, lease_id: str, ok: bool) -> None:
        with self._lock:
            lease = self._in_transfer.pop(lease_id)
        self._end(lease, "pulled" if ok else "aborted")

    def release(self, lease_id: str, token: bytes | None = None) -> bool:
        """End a lease early (token None: by the holder itself, e.g. on abort)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or (token is not None and not hmac.compare_digest(lease.token, token)):
                return False
            del self._leases[lease_id]
        self._end(lease, "released" if token is not None else "aborted")
        return True

    def extend(self, lease_id: str, token: bytes, ttl_s: float) -> Lease:
        with self._lock:
            lease = self._check(lease_id, token)
            lease.expires_at = time.monotonic() + ttl_s
            return lease

    def expire(self) -> int:
        now = time.monotonic()
        with self._lock:
            gone = [lease for lease in self._leases.values() if now >= lease.expires_at]
            for lease in gone:
                del self._leases[lease.lease_id]
        for lease in gone:
            self._end(lease, "expired")
        return len(gone)

    def _end(self, lease: Lease, reason: str) -> None:
        self.counts[reason] += 1
        lease.on_end(reason)

    def __len__(self) -> int:
        return len(self._leases) + len(self._in_transfer)

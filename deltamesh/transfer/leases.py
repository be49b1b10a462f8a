"""Leases: a prefill worker's promise to hold one request's state for a while.

A lease has an id (public), a secret token (given to whoever may pull the state and end the lease) and an
expiry. It ends exactly once: pulled, released, expired or aborted; its `on_end` callback then frees the held
memory.

Each live lease also owns one 64-bit *lease word* in a host array that one-sided transports let pullers read
(deltamesh/transfer/ucx/puller.py): it holds the lease's nonce while the lease lives and is zeroed the moment the lease
ends, before its memory is freed. A puller that reads the nonce back after its data reads have completed knows
the memory was not freed, so not reused, while they ran.

The nonce is not sent to the puller: it is a MAC, keyed by the lease's secret token, of the lease id and the
exact regions (address, size) the lease holds (`lease_nonce`). A puller computes it from the token and the
regions it read, so a pull with a wrong token, or of regions the lease does not name (another request's state),
can never match the word: its bytes are not used.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

MIN_TOKEN_BYTES = 16


class LeaseRefused(Exception):
    """The lease cannot be used; the message says why (safe to show the caller)."""


class RankBytes(Protocol):
    """Held bytes in another process of the holder's worker (one of its ranks): `nbytes` at `address` there."""

    rank: int
    address: int
    nbytes: int


Held = torch.Tensor | RankBytes  # a 1-D uint8 view of this process's memory, or another rank's bytes


def extent(buffer: Held) -> tuple[int, int]:
    """(address, bytes) of a held buffer, in the memory of the process holding it."""
    if isinstance(buffer, torch.Tensor):
        return buffer.data_ptr(), buffer.numel()
    return buffer.address, buffer.nbytes


@dataclass
class Lease:
    lease_id: str
    token: bytes
    buffers: list[Held]  # the held memory, in order
    expires_at: float  # time.monotonic()
    on_end: Callable[[str], None]  # called once with the reason: pulled | released | expired | aborted
    word: int  # index of its lease word
    nonce: int  # what its lease word holds while it lives (never 0): lease_nonce of its token and buffers

    @property
    def nbytes(self) -> int:
        return sum(extent(b)[1] for b in self.buffers)

    def expires_unix_ms(self) -> int:
        return int((time.time() + self.expires_at - time.monotonic()) * 1000)


def lease_nonce(token: bytes, lease_id: str, extents: list[tuple[int, int]]) -> int:
    """What the word of lease `lease_id` holding `extents` [(address, nbytes)] holds while it lives, under `token`.
    Positive as an int64 and with no zero byte: a read that tears across the word's reset to 0 (an 8-byte copy is
    not promised to be atomic) cannot match it."""
    message = lease_id.encode() + b"".join(struct.pack("<QQ", address, nbytes) for address, nbytes in extents)
    digest = hmac.new(token, message, hashlib.sha256).digest()
    raw = [b % 255 + 1 for b in digest[:7]] + [digest[7] % 127 + 1]
    return int.from_bytes(bytes(raw), "little")


class LeaseTable:
    def __init__(self, capacity: int = 4096):
        """`capacity`: leases alive at once (each holds a request's state, so the state pool bounds them first)."""
        self.words = torch.zeros(capacity, dtype=torch.int64)  # made readable by the transport's holder
        self._words = self.words.numpy()  # plain stores, no torch dispatch
        self._free_words = list(range(capacity - 1, -1, -1))
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.counts = {"pulled": 0, "released": 0, "expired": 0, "aborted": 0}

    def offer(
        self,
        lease_id: str,
        buffers: list[Held],
        ttl_s: float,
        on_end: Callable[[str], None],
        token: bytes | None = None,
    ) -> Lease:
        """`token`: the lease's secret (at least MIN_TOKEN_BYTES), if the caller chose it; else a random one."""
        if token is not None and len(token) < MIN_TOKEN_BYTES:
            raise LeaseRefused(f"a lease token must have at least {MIN_TOKEN_BYTES} bytes")
        with self._lock:
            if lease_id in self._leases:
                raise ValueError(f"lease {lease_id!r} already exists")
            if not self._free_words:
                raise LeaseRefused(f"too many leases alive ({len(self._leases)})")
            word = self._free_words.pop()
            token = token or secrets.token_bytes(MIN_TOKEN_BYTES)
            nonce = lease_nonce(token, lease_id, [extent(b) for b in buffers])
            lease = Lease(lease_id, token, buffers, time.monotonic() + ttl_s, on_end, word, nonce)
            self._words[word] = lease.nonce
            self._leases[lease_id] = lease
        return lease

    def _pop(self, lease_id: str, token: bytes | None) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is None or (token is not None and not hmac.compare_digest(lease.token, token)):
            return None
        return self._leases.pop(lease_id)

    def finish(self, lease_id: str, token: bytes, pulled: bool) -> bool:
        """The puller's notice: it has read the state (pulled) or gave up (aborted). False if the lease had
        already ended or the token is wrong."""
        with self._lock:
            lease = self._pop(lease_id, token)
        if lease is not None:
            self._end(lease, "pulled" if pulled else "aborted")
        return lease is not None

    def release(self, lease_id: str, token: bytes | None = None) -> bool:
        """End a lease early (token None: by the holder itself, e.g. when the lease never reached its caller;
        a caller from outside always presents the token)."""
        with self._lock:
            lease = self._pop(lease_id, token)
        if lease is not None:
            self._end(lease, "released" if token is not None else "aborted")
        return lease is not None

    def extend(self, lease_id: str, token: bytes, ttl_s: float) -> Lease:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseRefused(f"lease {lease_id!r} is unknown or ended")
            if not hmac.compare_digest(lease.token, token):
                raise LeaseRefused(f"wrong token for lease {lease_id!r}")
            if time.monotonic() >= lease.expires_at:
                raise LeaseRefused(f"lease {lease_id!r} has expired")
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
        # The word first: a puller whose reads are still running must see the lease gone before anything can
        # reuse its memory (on_end frees it; the engine's next writes into it are issued after that).
        # (The word may go to a new lease at once: its new nonce fails a stale puller just as 0 does.)
        self._words[lease.word] = 0
        with self._lock:
            self._free_words.append(lease.word)
        self.counts[reason] += 1
        lease.on_end(reason)

    def __len__(self) -> int:
        return len(self._leases)

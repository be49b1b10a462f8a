"""A puller's record of the holders the control plane announced, and the rule that binds a lease's word to the
memory it vouches for.

A pull's check (the lease word, read after the data: deltamesh/transfer/leases.py) proves the bytes were the lease's
only if the word is the one their holder zeroes before it frees them. A lease descriptor names where the word is and
which worker holds each region; without a rule, a caller holding the mesh secret could hand a decode worker a
descriptor naming another request's regions in a prefill worker (as that holder's "peer") and a word in memory of
its own, set to the value that matches, and have that state decoded for it. So, before any byte moves
(`KnownHolders.check`):

- every region is in the holder's own worker (the one its word is read from) or in a worker announced as one of
  its ranks (UcxHolderDescriptor.peer_addresses, from the holder's registration with the router);
- where the holder was announced, its word is one of the lease words it announced (address, alignment, key).

A worker address belongs to the first holder announced with it: a later announcement naming it again, as its own
or as a rank (someone registering a "worker" whose ranks are another worker's), is refused. The addresses are
UCX's, made when a process starts, so no one can name one before its owner registers it. A pull whose holder names
ranks but was not announced yet waits briefly for the announcement (UcxPuller.pull), then is refused.

Not covered (docs/RELIABILITY.md, threat model): a holder that was never announced (a prefill worker given to the
router with --prefill, the decode workers' prefix offers to prefill workers) may name no ranks, and its word is read
from its own memory but not checked against its lease words, which the puller does not know; and since only prefill
workers are announced (to decode workers), a caller holding the mesh secret can register a "prefill worker" that
names such a never-announced worker (a decode worker whose offers it has seen) as its rank.
"""

from __future__ import annotations

import asyncio

import structlog

from deltamesh.transfer.base import DescriptorError
from deltamesh.transfer.ucx.descriptors import WORD_BYTES, AnnouncedHolder, UcxSource, read_announced
from deltamesh.v1.common_pb2 import TransportDescriptor

log = structlog.get_logger("deltamesh.transfer")


class KnownHolders:
    def __init__(self):
        self._holders: dict[bytes, AnnouncedHolder] = {}  # a holder's worker address -> what it announced
        self._owner: dict[bytes, bytes] = {}  # a worker address -> the holder that announced it (itself or a rank)
        self._news: asyncio.Event | None = None  # set by the next announcement, for pulls awaiting one

    def announce(self, descriptor: TransportDescriptor) -> bool:
        """Record a holder the control plane announced; False (and nothing recorded) if it names a worker that
        another holder announced first. Raises DescriptorError for a descriptor that does not parse."""
        holder = read_announced(descriptor)
        known = self._holders.get(holder.address)
        if known == holder:
            return True
        taken = {a for a in (holder.address, *holder.ranks) if self._owner.get(a, holder.address) != holder.address}
        if known is not None or taken:
            log.warning(
                "side-channel announcement refused: it names a UCX worker that another announcement named first",
                holder=holder.address[:16].hex(),
            )
            return False
        self._holders[holder.address] = holder
        for address in (holder.address, *holder.ranks):
            self._owner[address] = holder.address
        if self._news is not None:
            self._news.set()
            self._news = None
        return True

    def check(self, source: UcxSource, final: bool = True) -> None:
        """Raise DescriptorError unless `source`'s regions and word are where its holder keeps leased memory.
        `final` False: a holder not announced yet may name workers no one announced (see `awaits_announcement`)."""
        holder = self._holders.get(source.address)
        ranks = holder.ranks if holder is not None else frozenset()
        strangers = {r.worker for r in source.regions} - {source.address, *ranks}
        if strangers and (final or holder is not None or strangers & self._owner.keys()):
            raise DescriptorError(
                "ucx descriptor: it names regions in a worker that was not announced as a rank of the holder whose "
                "lease word vouches for them"
            )
        words = holder.words if holder is not None else None
        if words is None:
            return
        offset = source.check.address - words.address
        if (
            not (0 <= offset <= words.nbytes - WORD_BYTES and offset % WORD_BYTES == 0)
            or source.check.rkey != words.rkey
        ):
            raise DescriptorError("ucx descriptor: its lease word is not one of the lease words its holder announced")

    def awaits_announcement(self, source: UcxSource) -> bool:
        """Only an announcement of its holder can vouch for `source`: the holder names other workers as its ranks
        but was not announced (yet). A parallel prefill worker is routed to once the router finds it healthy,
        which may be up to a heartbeat before the decode workers hear of it."""
        return source.address not in self._holders and any(r.worker != source.address for r in source.regions)

    async def announced(self, address: bytes, timeout_s: float) -> None:
        """Until the holder at `address` is announced, or `timeout_s` passed."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while address not in self._holders:
            self._news = self._news or asyncio.Event()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._news.wait()
            except TimeoutError:
                return

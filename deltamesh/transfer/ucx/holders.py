"""A puller's record of the holders the control plane announced, and the rule that binds a lease's word to the
memory it vouches for.

A pull's check (the lease word, read after the data: deltamesh/transfer/leases.py) proves the bytes were the lease's
only if the word is the one their holder zeroes before it frees them. A lease descriptor names where the word is and
which worker holds each region; without a rule, a caller holding the mesh secret could hand a puller a descriptor
naming another request's regions in a holder (as that holder's "peer") and a word in memory of its own, set to the
value that matches, and have that state decoded for it. So, before any byte moves (`KnownHolders.check`):

- the holder (the worker its word is read from) was announced by the control plane: the router announces every
  worker that holds state (prefill workers to decode workers, decode workers' prefix offers to prefill workers),
  static or registered;
- every region is in the holder's own worker or in a worker it announced as one of its ranks
  (UcxHolderDescriptor.peer_addresses);
- its word is one of the lease words the holder announced (address, alignment, key).

A worker address belongs to the first holder announced with it: a later announcement naming it again, as its own
or as a rank (someone posing as a "worker" whose ranks are another worker's), is refused here, and the router
already refuses to announce a worker whose description names another's (TransportDescriptor.endpoints). The
addresses are UCX's, made when a process starts, so no one can name one before its owner runs. A source whose
holder was not announced yet is let through `source()` when it names no announced worker's memory, and its pull
waits briefly for the announcement (UcxPuller.pull), then is refused: the router announces a new worker at its next
load poll, which may come after a request was routed to it.
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
        """Raise DescriptorError unless `source`'s holder was announced and its regions and word are where that
        holder keeps leased memory. `final` False: a holder not announced yet passes if it names no announced
        worker's memory (see `awaits_announcement`)."""
        holder = self._holders.get(source.address)
        if holder is None:
            if {source.address, *(r.worker for r in source.regions)} & self._owner.keys():
                raise DescriptorError(
                    "ucx descriptor: it names regions in a worker that was not announced as a rank of the holder "
                    "whose lease word vouches for them"
                )
            if final:
                raise DescriptorError(
                    "ucx descriptor: its holder was not announced by the control plane (a worker this one pulls from)"
                )
            return
        if {r.worker for r in source.regions} - {source.address, *holder.ranks}:
            raise DescriptorError(
                "ucx descriptor: it names regions in a worker that was not announced as a rank of the holder whose "
                "lease word vouches for them"
            )
        words = holder.words
        if words is None:
            raise DescriptorError("ucx descriptor: its holder announced no lease words")
        offset = source.check.address - words.address
        if (
            not (0 <= offset <= words.nbytes - WORD_BYTES and offset % WORD_BYTES == 0)
            or source.check.rkey != words.rkey
        ):
            raise DescriptorError("ucx descriptor: its lease word is not one of the lease words its holder announced")

    def awaits_announcement(self, source: UcxSource) -> bool:
        """Only an announcement of its holder can vouch for `source`, and it has not come (yet). A worker is routed
        to once the router finds it healthy, up to a load poll before the workers pulling from it hear of it."""
        return source.address not in self._holders

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

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
UCX's, made when a process starts, so no one can name one before its owner registers it.

Not covered: a holder that was never announced (a prefill worker given to the router with --prefill, the decode
workers' prefix offers to prefill workers) may name no ranks, and its word is read from its own memory but not
checked against its lease words, which the puller does not know (docs/RELIABILITY.md, threat model).
"""

from __future__ import annotations

import structlog

from deltamesh.transfer.base import DescriptorError
from deltamesh.transfer.ucx.descriptors import WORD_BYTES, AnnouncedHolder, UcxSource, read_announced
from deltamesh.v1.common_pb2 import TransportDescriptor

log = structlog.get_logger("deltamesh.transfer")


class KnownHolders:
    def __init__(self):
        self._holders: dict[bytes, AnnouncedHolder] = {}  # a holder's worker address -> what it announced
        self._owner: dict[bytes, bytes] = {}  # a worker address -> the holder that announced it (itself or a rank)

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
        return True

    def check(self, source: UcxSource) -> None:
        """Raise DescriptorError unless `source`'s regions and word are where its holder keeps leased memory."""
        holder = self._holders.get(source.address)
        ranks = holder.ranks if holder is not None else frozenset()
        if any(r.worker not in (source.address, *ranks) for r in source.regions):
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

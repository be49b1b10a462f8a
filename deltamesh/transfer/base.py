"""The transport seam: what workers see of a state transfer, whatever moves the bytes.

A *holder* keeps a request's state in its own memory under a lease (deltamesh/transfer/leases.py) and offers it:
`StateHolder.offer` returns a transport descriptor, everything a puller needs to reach that state over the
holder's transport besides the lease's id and token and the sizes of the held regions (StateLayout). A *puller*
turns those into a source (`StatePuller.source`: checked, nothing moves yet) and pulls it into buffers of its own
(`StatePuller.pull`), under a deadline; cancelling the pull, or its deadline, abandons it and the holder frees
the state at once. Neither side names a role: a decode worker pulling from a prefill worker and a prefill worker
pulling from a decode worker (a prefix cache) go through the same calls.

Descriptors are `deltamesh.v1.TransportDescriptor` messages: the transport's name (`kind`), the version of its
payload's format and the payload, the transport's own message serialised. Only deltamesh/transfer/<kind>/ reads or writes
a payload; a puller refuses a kind or version it does not speak before any byte moves (DescriptorError).

A lease ends through its LeaseTable, whoever ends it: the puller's done or abandon notice (carried by the
transport), the holder's own release, its expiry. The table zeroes the lease's word before the held memory is
freed, so a one-sided transport can check, after its reads, that the memory stayed the lease's while they ran.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from deltamesh.v1.common_pb2 import TransportDescriptor

if TYPE_CHECKING:
    import torch

    from deltamesh.transfer.leases import Held, Lease, LeaseTable


class TransferError(RuntimeError):
    """A pull failed; `refused` is true when the holder refused it before moving bytes."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class DescriptorError(ValueError):
    """A transport descriptor this puller cannot use (another transport, a version it does not speak, a payload
    that does not parse or does not fit the state's regions): refused before any byte moves."""


@dataclass(frozen=True)
class LeaseKey:
    """What a puller holds of a lease: its id and its secret token (which the holder checks a pull against, and
    which ends the lease)."""

    lease_id: str
    token: bytes


@dataclass(frozen=True)
class Source:
    """A held state as one transport's puller reaches it: made from a descriptor by `StatePuller.source`."""

    lease: LeaseKey


@dataclass
class TransferStats:
    nbytes: int
    buffers: int  # reads on the wire (segments)
    # perf_counter() at each step of the pull ("start", "keys": endpoint and keys looked up, "posted": every read
    # posted, "reads": every read done, "done": the lease word checked); on Linux that clock is CLOCK_MONOTONIC,
    # shared by the processes of one host, so they line up with a holder's timeline
    marks: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.marks["done"] - self.marks["start"]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def segments(src: list[int], dst: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Split two region lists of equal total size at every boundary of either:
    [(src_index, src_offset, dst_index, dst_offset, nbytes)]."""
    if sum(src) != sum(dst):
        raise TransferError(f"state sizes differ: holder {sum(src)} bytes, puller {sum(dst)} bytes", refused=True)
    out, i, j, si, dj = [], 0, 0, 0, 0
    while i < len(src) and j < len(dst):
        n = min(src[i] - si, dst[j] - dj)
        if n:
            out.append((i, si, j, dj, n))
        si, dj = si + n, dj + n
        if si == src[i]:
            i, si = i + 1, 0
        if dj == dst[j]:
            j, dj = j + 1, 0
    return out


def payload_of(descriptor: TransportDescriptor, kind: str, version: int) -> bytes:
    """The payload of a descriptor of transport `kind` at `version`; DescriptorError for any other."""
    if not descriptor.kind:
        raise DescriptorError("no transport descriptor")
    if descriptor.kind != kind or descriptor.version != version:
        raise DescriptorError(
            f"transport {descriptor.kind!r} version {descriptor.version} is not spoken here "
            f"(this worker's transport: {kind!r} version {version})"
        )
    return descriptor.payload


class StateHolder(ABC):
    """Holder side: makes state held under leases (in the LeaseTable it was made with) readable by pullers."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def describe(self, pools: list[Held]) -> TransportDescriptor:
        """How a puller reaches this holder at all, `pools` being the memory pullers warm their reads up with (made
        readable now, once): what the control plane announces to pullers (`StatePuller.announce`) and a puller
        warms up with (`StatePuller.warm`) before its first pull from here. Its `endpoints` name the processes
        whose memory this holder's leases may name, for the router to keep two workers from claiming one."""

    @abstractmethod
    def offer(self, lease: Lease) -> TransportDescriptor:
        """What a puller of `lease` (its buffers, in order) needs besides the lease's id and token and the
        buffers' sizes."""

    @abstractmethod
    def add_ranks(self, memory: dict[int, bytes]) -> None:
        """What the worker's other ranks made readable of their memory (rank -> the bytes its transport's
        `rank_exporter` returned there), for leases and descriptions naming their bytes (leases.RankBytes)."""


class StatePuller(ABC):
    """Puller side: reads held state straight into buffers of its own (1-D uint8 tensors, host or GPU)."""

    @abstractmethod
    async def start(self) -> None:
        """Set the transport up now rather than on the first pull, which would stall the caller's loop."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def source(self, descriptor: TransportDescriptor, lease: LeaseKey, region_bytes: Sequence[int]) -> Source:
        """The state that `descriptor` describes, held under `lease` in regions of `region_bytes`, as this puller
        reaches it. Raises DescriptorError (another transport or version, a malformed payload, memory the holder
        it names cannot vouch for: see `announce`); moves nothing."""

    @abstractmethod
    def announce(self, holder: TransportDescriptor) -> bool:
        """The control plane announced this holder (`StateHolder.describe` of a worker this one may pull from):
        where its leases' memory may be. Only announced holders' sources are pulled, each checked against its
        announcement. False when the transport refuses the announcement (it names memory another announced holder
        named first); raises DescriptorError for one it cannot read."""

    @abstractmethod
    async def pull(self, source: Source, buffers: list[torch.Tensor], timeout_s: float) -> TransferStats:
        """Fill `buffers` (of the same total size) with the state, or raise TransferError (the buffers are then
        undefined; give them back through `release_after`). A source whose holder was not announced waits for the
        announcement a while (less than its deadline), then is refused. Cancelling it abandons the pull."""

    @abstractmethod
    def release_after(self, lease_id: str, release: Callable[[], None]) -> None:
        """Call `release()` once the failed pull of `lease_id` can no longer write into its buffers."""

    @abstractmethod
    async def warm(self, holder: TransportDescriptor, device: torch.device, timeout_s: float) -> float:
        """Do now, for the holder `holder` describes (`StateHolder.describe`), what the transport would set up on
        the first pull from it, reading into `device` memory. Returns the seconds taken; raises TransferError or
        DescriptorError."""


class Transport(ABC):
    """One way of moving held state between workers: makes the holder and the puller of a process."""

    kind: ClassVar[str]  # its name (--transport) and its descriptors' kind
    version: ClassVar[int]  # of its descriptors' payloads
    # "module:function" that a parallel worker's other ranks call once at start with their pools (1-D byte
    # views) to make them readable where they are, returning bytes for the holder (`StateHolder.add_ranks`)
    rank_exporter: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_settings(cls, settings) -> Transport:
        """The transport of a worker with these WorkerSettings; made before anything else in the process starts."""

    @abstractmethod
    def holder(self, leases: LeaseTable) -> StateHolder: ...

    @abstractmethod
    def puller(self, settle_grace_s: float = 10.0) -> StatePuller:
        """`settle_grace_s`: how long a failed pull's buffers may stay unusable at most (see `release_after`)."""

    @abstractmethod
    def close(self) -> None:
        """After its holder and puller have stopped: release what the process holds of the transport."""

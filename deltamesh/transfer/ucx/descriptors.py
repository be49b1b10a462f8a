"""The UCX transport's descriptors (protos/deltamesh/v1/ucx.proto), made by the holder and read by the puller:
where each held region is (in which worker's memory: the holder's own, or a peer's, another rank of the same
worker) and the key to read it, where the lease's word is; and for a warm-up, where the holder's pools and
lease words are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from deltamesh.transfer.base import DescriptorError, LeaseKey, Source, payload_of
from deltamesh.transfer.leases import lease_nonce
from deltamesh.v1 import ucx_pb2
from deltamesh.v1.common_pb2 import TransportDescriptor

KIND, VERSION = "ucx", 2
WORD_BYTES = 8


@dataclass(frozen=True)
class RemoteRegion:
    """One region of the holder's memory as a puller reads it: its size, where it starts, and the packed UCX
    remote key of the registered memory around it."""

    nbytes: int
    address: int
    rkey: bytes
    worker: bytes = b""  # the UCX worker address of the process holding it; empty: the holder's own


@dataclass(frozen=True)
class LeaseCheck:
    """Where a lease's word is in the holder's memory (registered host memory, and its packed remote key), and
    the nonce it holds while the lease lives."""

    address: int
    rkey: bytes
    nonce: int

    @classmethod
    def of(cls, word: RemoteRegion, lease: LeaseKey, regions: Sequence[RemoteRegion]) -> LeaseCheck:
        """The check of a pull of `regions` under `lease`: what its word must hold."""
        extents = [(r.address, r.nbytes) for r in regions]
        return cls(word.address, word.rkey, lease_nonce(lease.token, lease.lease_id, extents))


@dataclass(frozen=True)
class UcxSource(Source):
    """A held state as the UCX puller reads it: the holder's worker address, the regions, the lease's check."""

    address: bytes
    regions: tuple[RemoteRegion, ...]
    check: LeaseCheck


def _peers(regions: Sequence[RemoteRegion]) -> tuple[list[bytes], list[int]]:
    """(the peers' worker addresses, each region's peer: 0 the holder, i the (i-1)-th peer); ([], []) when every
    region is the holder's."""
    peers: list[bytes] = []
    index: list[int] = []
    for r in regions:
        if r.worker and r.worker not in peers:
            peers.append(r.worker)
        index.append(peers.index(r.worker) + 1 if r.worker else 0)
    return peers, index if peers else []


def lease_descriptor(address: bytes, regions: Sequence[RemoteRegion], word: RemoteRegion) -> TransportDescriptor:
    peers, region_peers = _peers(regions)
    payload = ucx_pb2.UcxLeaseDescriptor(
        worker_address=address,
        region_addresses=[r.address for r in regions],
        region_rkeys=[r.rkey for r in regions],
        word_address=word.address,
        word_rkey=word.rkey,
        peer_addresses=peers,
        region_peers=region_peers,
    )
    return TransportDescriptor(kind=KIND, version=VERSION, payload=payload.SerializeToString())


def holder_descriptor(address: bytes, pools: Sequence[RemoteRegion], words: RemoteRegion) -> TransportDescriptor:
    peers, pool_peers = _peers(pools)
    payload = ucx_pb2.UcxHolderDescriptor(
        worker_address=address,
        pool_addresses=[r.address for r in pools],
        pool_rkeys=[r.rkey for r in pools],
        lease_words_address=words.address,
        lease_words_rkey=words.rkey,
        lease_words_bytes=words.nbytes,
        peer_addresses=peers,
        pool_peers=pool_peers,
    )
    endpoints = [address, *peers]  # what the router compares between workers, unread
    return TransportDescriptor(kind=KIND, version=VERSION, payload=payload.SerializeToString(), endpoints=endpoints)


def _workers(address: bytes, peers: Sequence[bytes], index: Sequence[int], count: int) -> list[bytes]:
    """The worker address of each of `count` regions: the holder's (`address`) or a peer's."""
    if not index:
        return [address] * count
    if len(index) != count or any(i > len(peers) for i in index) or not all(peers):
        raise DescriptorError(
            f"ucx descriptor: one peer index per region needed ({count} regions, {len(index)} "
            f"indices, {len(peers)} peers)"
        )
    return [peers[i - 1] if i else address for i in index]


def read_lease(descriptor: TransportDescriptor, lease: LeaseKey, region_bytes: Sequence[int]) -> UcxSource:
    """The source a lease descriptor names, for regions of `region_bytes`; DescriptorError if it names none."""
    d = _parse(descriptor, ucx_pb2.UcxLeaseDescriptor)
    if not len(region_bytes) == len(d.region_addresses) == len(d.region_rkeys):
        raise DescriptorError(
            f"ucx descriptor: one address and key per region needed ({len(region_bytes)} regions, "
            f"{len(d.region_addresses)} addresses, {len(d.region_rkeys)} keys)"
        )
    if not (d.worker_address and d.word_address and d.word_rkey):
        raise DescriptorError("ucx descriptor: the holder's address and the lease word's address and key are needed")
    workers = _workers(d.worker_address, d.peer_addresses, d.region_peers, len(region_bytes))
    regions = tuple(RemoteRegion(*r) for r in zip(region_bytes, d.region_addresses, d.region_rkeys, workers))
    word = RemoteRegion(WORD_BYTES, d.word_address, d.word_rkey)
    return UcxSource(lease, d.worker_address, regions, LeaseCheck.of(word, lease, regions))


def read_holder(descriptor: TransportDescriptor) -> tuple[bytes, list[RemoteRegion], RemoteRegion | None]:
    """(worker address, one byte of each pool (with its worker's address), the lease words or None) of a holder
    descriptor."""
    d = _parse(descriptor, ucx_pb2.UcxHolderDescriptor)
    if len(d.pool_addresses) != len(d.pool_rkeys) or not d.worker_address:
        raise DescriptorError("ucx holder descriptor: the holder's address and one key per pool are needed")
    workers = _workers(d.worker_address, d.peer_addresses, d.pool_peers, len(d.pool_addresses))
    pools = [RemoteRegion(1, *r) for r in zip(d.pool_addresses, d.pool_rkeys, workers)]
    words = (
        RemoteRegion(WORD_BYTES, d.lease_words_address, d.lease_words_rkey, d.worker_address)
        if d.lease_words_rkey
        else None
    )
    return d.worker_address, pools, words


@dataclass(frozen=True)
class AnnouncedHolder:
    """What a holder descriptor says of the memory its leases may name: its worker's address, its other ranks'
    (peers'), and where its lease words are (None: not said)."""

    address: bytes
    ranks: frozenset[bytes]
    words: RemoteRegion | None


def read_announced(descriptor: TransportDescriptor) -> AnnouncedHolder:
    d = _parse(descriptor, ucx_pb2.UcxHolderDescriptor)
    if not d.worker_address or not all(d.peer_addresses):
        raise DescriptorError("ucx holder descriptor: the holder's and every peer's worker address are needed")
    if set(descriptor.endpoints) != {d.worker_address, *d.peer_addresses}:
        # the router keeps two workers from claiming one endpoint by these: they must be what the payload names
        raise DescriptorError("ucx holder descriptor: its endpoints are not the worker addresses it names")
    words = None
    if d.lease_words_bytes and d.lease_words_rkey:
        words = RemoteRegion(d.lease_words_bytes, d.lease_words_address, d.lease_words_rkey, d.worker_address)
    return AnnouncedHolder(d.worker_address, frozenset(d.peer_addresses), words)


def _parse(descriptor: TransportDescriptor, cls):
    message = cls()
    try:
        message.ParseFromString(payload_of(descriptor, KIND, VERSION))
    except DecodeError as e:
        raise DescriptorError(f"ucx descriptor: its payload is not a {cls.__name__}: {e}") from None
    return message

"""Holder side of the UCX transport: registers the memory pullers read (pools once, the lease words), says
where a lease's regions and word are, and ends leases on the pullers' notices. It takes no part in a pull.
A parallel worker's other ranks register their own pools (rank_memory.py); a region held there is named
with that rank's UCX worker and key (`add_ranks`)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from deltamesh.transfer.base import StateHolder
from deltamesh.transfer.leases import Held, Lease, LeaseTable, RankBytes
from deltamesh.transfer.ucx import descriptors, loop_worker, notices
from deltamesh.transfer.ucx.descriptors import RemoteRegion
from deltamesh.v1 import ucx_pb2
from deltamesh.v1.common_pb2 import TransportDescriptor

if TYPE_CHECKING:
    from deltamesh.transfer.ucx.rma import Registration

log = structlog.get_logger("deltamesh.transfer")


class UcxHolder(StateHolder):
    def __init__(self, leases: LeaseTable):
        self.leases = leases
        self._task: asyncio.Task | None = None
        self._registered: dict[tuple[int, int], Registration] = {}  # (start, bytes) of an allocation -> its own
        # the last notices: lease id and perf_counter() when the done notice arrived (see TransferStats.marks)
        self.timeline: deque[dict] = deque(maxlen=256)
        self.address = b""
        # rank -> (its UCX worker's address, [(start, size, packed key)] of what it registered)
        self._ranks: dict[int, tuple[bytes, list[tuple[int, int, bytes]]]] = {}

    async def start(self) -> None:
        self.address = loop_worker.get().address
        self.words()  # registered before any lease points into it
        self._task = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for registration in self._registered.values():
            registration.close()
        self._registered.clear()

    def describe(self, pools: list[Held]) -> TransportDescriptor:
        return descriptors.holder_descriptor(self.address, self.regions(pools), self.words())

    def add_ranks(self, memory: dict[int, bytes]) -> None:
        for rank, exported in memory.items():
            m = ucx_pb2.UcxRankMemory.FromString(exported)
            self._ranks[rank] = (m.worker_address, list(zip(m.starts, m.sizes, m.rkeys)))

    def offer(self, lease: Lease) -> TransportDescriptor:
        return descriptors.lease_descriptor(self.address, self.regions(lease.buffers), self.word_of(lease))

    def regions(self, buffers: list[Held]) -> list[RemoteRegion]:
        """Where `buffers` (views of this worker's pools, or bytes of another rank's) can be read by a puller.
        The allocation behind each view is registered with UCX on first use and stays registered: pools live as
        long as the worker."""
        out = []
        for b in buffers:
            if not isinstance(b, torch.Tensor):
                out.append(self._rank_region(b))
                continue
            storage = b.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
            registration = self._registered.get((start, size))
            if registration is None:
                registration = loop_worker.get().register(start, size, b.is_cuda)
                self._registered[(start, size)] = registration
            out.append(RemoteRegion(b.numel(), b.data_ptr(), registration.rkey))
        return out

    def _rank_region(self, b: RankBytes) -> RemoteRegion:
        worker, registered = self._ranks[b.rank]
        for start, size, rkey in registered:
            if start <= b.address and b.address + b.nbytes <= start + size:
                return RemoteRegion(b.nbytes, b.address, rkey, worker)
        raise ValueError(f"rank {b.rank} registered no memory holding {b.nbytes} bytes at {b.address:#x}")

    def words(self) -> RemoteRegion:
        """Where the lease words are (host memory): what a puller's warm-up reads besides the pools."""
        return self.regions([self.leases.words.view(torch.uint8)])[0]

    def word_of(self, lease: Lease) -> RemoteRegion:
        """Where the word of `lease` is: what its puller reads after the data, and must find the nonce in."""
        words, size = self.words(), self.leases.words.element_size()
        return RemoteRegion(size, words.address + lease.word * size, words.rkey)

    async def _serve(self) -> None:
        ucx = loop_worker.get()
        while True:
            buf = np.empty(notices.MAX_NOTICE_BYTES, dtype=np.uint8)
            try:
                await ucx.recv(buf, notices.NOTICE_TAG, listening=True)
                received = time.perf_counter()
                notice = notices.unframe(buf, ucx_pb2.PullNotice)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # malformed or truncated: drop it, keep serving
                log.warning("bad pull notice", error=str(e))
                continue
            if not notice.lease_id:  # a puller's warm-up (UcxPuller.warm)
                continue
            if not self.leases.finish(notice.lease_id, notice.token, pulled=notice.done):
                continue  # ended already (expired, released) or a wrong token
            if notice.done:
                self.timeline.append({"lease_id": notice.lease_id, "done": received})
            else:
                log.warning("pull abandoned by the puller", lease_id=notice.lease_id)

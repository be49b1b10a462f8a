"""Puller side of the UCX transport (ucxx + UCX RMA): reads leased state straight from the holder's memory.

No listening socket: each side publishes its UCX *worker address* through the gRPC control plane, in its
transport descriptors. The holder registers its pools with UCX once; with each lease it hands out, in the lease's
transport descriptor (deltamesh/transfer/ucx/descriptors.py), where the held regions are, the remote keys to read them, and
where the lease's *word* is (deltamesh/transfer/ucx/holder.py). A pull is one-sided:

1. The puller reads every region straight into its own buffers (one RMA get per segment, zero-copy at both
   ends), from the process that holds it: the holder's, or another rank's of the same worker (a worker over
   several ranks holds a request's state where the rank that computed it keeps it).
2. Once every read has completed it reads the lease word (8 bytes). The holder zeroes a lease's word when the
   lease ends, before it frees the lease's memory (deltamesh.transfer.leases); so finding the lease's nonce there means
   the memory was neither freed nor reused while the reads ran, and the bytes are good. The nonce is a MAC of
   the lease id and the regions read, keyed by the lease token (`LeaseCheck.of`): only a puller with the token
   that read exactly the lease's regions can match it. Anything else (the lease ended: pulled, released,
   expired; a wrong token; another lease's regions) fails the pull as refused; its bytes are never used.
3. The puller sends a done notice: the lease ends as pulled and the held memory is freed. A puller that gives
   up (cancelled, past its deadline) sends an abandon notice instead, and the lease ends as aborted.

Why this shape: the holder's event loop is off the pull's path entirely (it shares the GIL with the holder's
engine and wakes up slowly), and nothing but the data and one word crosses before the bytes count. Everything
is bounded by a deadline. Buffers are 1-D uint8 tensors (CPU or CUDA); UCX reads CUDA memory with cuda_ipc /
NVLink on a GPU host, no host staging, and the lease word (host memory) over CMA or shared memory on one host.
The UCX worker is progressed by the event loop (deltamesh/transfer/ucx/loop_worker.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog
import torch

from deltamesh.transfer import failpoints
from deltamesh.transfer.base import (
    DescriptorError,
    LeaseKey,
    Source,
    StatePuller,
    TransferError,
    TransferStats,
    segments,
)
from deltamesh.transfer.ucx import descriptors, loop_worker, notices
from deltamesh.transfer.ucx.descriptors import UcxSource
from deltamesh.transfer.ucx.endpoints import Endpoints
from deltamesh.transfer.ucx.holders import KnownHolders
from deltamesh.v1 import ucx_pb2
from deltamesh.v1.common_pb2 import TransportDescriptor

log = structlog.get_logger("deltamesh.transfer")

# How long (at most, and at most half its deadline) a pull from a holder not announced yet waits for the control plane
# to announce it: the router announces a holder to its pullers as its report comes, a failed call again within half a
# second by default (router/registry.py)
ANNOUNCEMENT_WAIT_S = 2.0


class UcxPuller(StatePuller):
    def __init__(
        self,
        error_handling: bool = True,
        settle_grace_s: float = 10.0,
        spin_s: float = 0.02,
        interface: str | None = None,
    ):
        """`error_handling`: UCX peer error handling (a dead holder is reported). `spin_s`: how long a pull into
        GPU buffers may keep the event loop progressing UCX on every turn instead of waiting to be woken (see
        loop_worker); 0 never spins. Host pulls never spin: their bytes are copied by CPU cores, which spinning
        would take away. `interface`: the network interface the side channel also uses (UcxTransport), named
        when a holder is out of reach."""
        self._eps = Endpoints(error_handling, interface)
        self._holders = KnownHolders()
        self.spin_s = spin_s
        self._notices: set[asyncio.Future] = set()  # done and abandon notices on their way
        # failed pulls whose reads may still write into their buffers: lease id -> resolves when they no longer can
        self._unsettled: dict[str, asyncio.Future] = {}
        self.settle_grace_s = settle_grace_s

    async def start(self) -> None:
        loop_worker.get()  # the UCX context and worker

    async def close(self) -> None:
        if self._notices:
            await asyncio.wait(self._notices, timeout=1.0)
        self._eps.close()

    def source(self, descriptor: TransportDescriptor, lease: LeaseKey, region_bytes: Sequence[int]) -> UcxSource:
        source = descriptors.read_lease(descriptor, lease, region_bytes)
        self._holders.check(source, final=False)  # the word is where the holder of these regions keeps lease words
        return source

    def announce(self, holder: TransportDescriptor) -> bool:
        return self._holders.announce(holder)

    def _vouched(self, source: UcxSource) -> None:
        try:
            self._holders.check(source)
        except DescriptorError as e:
            raise TransferError(str(e), refused=True) from None

    async def warm(self, holder: TransportDescriptor, device: torch.device, timeout_s: float) -> float:
        """What UCX sets up on the first pull from a holder: the endpoint, the remote keys, the first read of each
        of its pools into `device` memory (cuda_ipc opens the holder's allocations), of its lease words into host
        memory, and the first notice. UCX chooses its protocols for each kind of operation on first use, and that
        blocks the event loop (and the engine step beside it) far longer than the operation itself."""
        address, pools, words = descriptors.read_holder(holder)
        ucx = loop_worker.get()
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                self._eps.get(address)
                reads = [(r, torch.empty(1, dtype=torch.uint8, device=device)) for r in pools]
                reads += [(words, torch.empty(words.nbytes, dtype=torch.uint8))] if words else []
                await asyncio.gather(
                    *(
                        ucx.get(self._eps.get(r.worker), into, r.address, self._eps.rkey(r.worker, r.rkey))
                        for r, into in reads
                    )
                )
                # no lease id: the holder skips it. The endpoint is looked up again: a pull that failed meanwhile
                # closed the one the reads went through, and a send on a closed endpoint crashes the process
                await ucx.send(self._eps.get(address), notices.frame(ucx_pb2.PullNotice()), notices.NOTICE_TAG)
        except Exception as e:  # unreachable or gone: the first pull will find out again
            for worker in {address, *(r.worker for r in pools)}:
                self._eps.drop(worker)
            raise TransferError(f"UCX warm-up with a holder failed: {e!r}") from e
        return time.perf_counter() - started

    def release_after(self, lease_id: str, release) -> None:
        """A read already posted completes into its buffer whatever happened to the pull, and buffers reused by
        then would be overwritten silently. So: at once when no read was posted, else when the reads are done, and
        at the latest after `settle_grace_s` (a read that needs the holder's help, as over TCP, waits for a
        stalled holder)."""
        settled = self._unsettled.pop(lease_id, None)
        if settled is None or settled.done():
            release()
            return
        done = False

        def fire(*_) -> None:
            nonlocal done
            if not done:
                done = True
                timer.cancel()
                release()

        timer = asyncio.get_running_loop().call_later(self.settle_grace_s, fire)
        settled.add_done_callback(fire)

    def _notify(self, address: bytes, lease: LeaseKey, **kind) -> None:
        """Fire and forget a done or abandon notice to the holder at `address`, on its endpoint as it is now (one
        closed by another operation's failure is made anew: sending on a closed endpoint crashes the process)."""
        notice = ucx_pb2.PullNotice(lease_id=lease.lease_id, token=lease.token, **kind)
        try:
            sent = loop_worker.get().send(self._eps.get(address), notices.frame(notice), notices.NOTICE_TAG)
        except Exception as e:  # the holder out of reach now: its lease ends by its TTL
            log.info("pull notice not sent", error=repr(e))
            return
        self._notices.add(sent)
        sent.add_done_callback(self._notice_sent)

    def _notice_sent(self, notice: asyncio.Future) -> None:
        self._notices.discard(notice)
        if not notice.cancelled() and notice.exception():  # the holder is gone: its memory went with it
            log.info("pull notice not delivered", error=repr(notice.exception()))

    async def pull(self, source: Source, buffers: list[torch.Tensor], timeout_s: float) -> TransferStats:
        assert isinstance(source, UcxSource), "a source this transport made (source())"
        started = time.perf_counter()
        lease_id = source.lease.lease_id
        try:
            async with asyncio.timeout(timeout_s):  # in this task: no extra task, no loop turn before the reads
                if self._holders.awaits_announcement(source):
                    await self._holders.announced(source.address, min(timeout_s / 2, ANNOUNCEMENT_WAIT_S))
                self._vouched(source)  # against its holder's announcement, which may have come since `source()`
                return await self._pull(source, buffers, started)
        except TimeoutError:
            for worker in _workers(source):
                self._eps.forget(worker)  # closing the holder's would cancel the abandon notice just posted
            message = f"state transfer for lease {lease_id!r} did not finish within {timeout_s:.1f}s"
            raise TransferError(message) from None
        except TransferError:
            raise
        except Exception as e:  # UCX errors: the holder is unreachable or went away mid-transfer
            for worker in _workers(source):
                self._eps.drop(worker)
            raise TransferError(f"state transfer for lease {lease_id!r} failed: {e!r}") from e

    async def _pull(self, source: UcxSource, buffers: list[torch.Tensor], started: float) -> TransferStats:
        ucx = loop_worker.get()
        address, regions, check = source.address, source.regions, source.check
        plan = segments([r.nbytes for r in regions], [b.numel() for b in buffers])
        spin_s = self.spin_s if buffers and buffers[0].is_cuda else 0.0
        ep = None
        reads: list[asyncio.Future] = []
        try:
            await failpoints.hit("deltamesh.transfer.before_reads")  # a pull that stalls before any read is posted
            ep = self._eps.get(address)
            eps = [self._eps.get(r.worker) for r in regions]  # the holder's, or another rank's of the same worker
            keys = [self._eps.rkey(r.worker, r.rkey) for r in regions]  # unpacked once per peer; a bad one fails here
            keyed = time.perf_counter()
            reads = [
                ucx.get(eps[i], buffers[j][dst_off : dst_off + n], regions[i].address + src_off, keys[i], spin_s=spin_s)
                for i, src_off, j, dst_off, n in plan
            ]
            posted = time.perf_counter()
            word_key = self._eps.rkey(address, check.rkey)  # while the reads run
            word = torch.empty(descriptors.WORD_BYTES, dtype=torch.uint8)  # what the check reads into
            for r in reversed(reads):  # the last posted is usually done last: one wake-up, where gather costs two
                await r
            read = time.perf_counter()
            await failpoints.hit("deltamesh.transfer.before_check")
            # Only now, with every read complete: the lease word still holding the nonce means the lease had not
            # ended, so its memory had not been freed or reused, while they ran.
            await ucx.get(ep, word, check.address, word_key, spin_s=spin_s)
            if int.from_bytes(word.numpy().tobytes(), "little") != check.nonce:
                raise TransferError(
                    f"lease {source.lease.lease_id!r} ended before its state was read (pulled, "
                    "released or expired), or the token or regions are not the lease's: the bytes "
                    "read are not used",
                    refused=True,
                )
        except BaseException as e:
            for f in reads:
                f.cancel()
            if reads:  # posted reads still land in the buffers: they are free again once those are done
                self._unsettled[source.lease.lease_id] = ucx.settled(reads)
            if reads and not (isinstance(e, TransferError) and e.refused):
                self._notify(address, source.lease, abandon=True)  # the holder frees the state now
            raise
        done = time.perf_counter()
        self._notify(address, source.lease, done=True)
        marks = {"start": started, "keys": keyed, "posted": posted, "reads": read, "done": done}
        return TransferStats(sum(n for *_, n in plan), len(plan), marks)


def _workers(source: UcxSource) -> set[bytes]:
    """Every worker a pull of `source` reads from: the holder's and its peers'."""
    return {source.address, *(r.worker for r in source.regions)}

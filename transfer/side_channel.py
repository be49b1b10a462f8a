"""The UCX side channel (ucxx + UCX RMA) that moves a request's state from a prefill worker to a decode worker.

No listening socket: each side publishes its UCX *worker address* through the gRPC control plane. The holder
(prefill) registers its pools with UCX once; with each lease it hands out, through the control plane, where
the held regions are, the remote keys to read them, and where the lease's *word* is (`StateServer.regions`,
`StateServer.lease_check`). A pull is one-sided:

1. The puller (decode) reads every region straight into its own buffers (one RMA get per segment, zero-copy at
   both ends).
2. Once every read has completed it reads the lease word (8 bytes). The holder zeroes a lease's word when the
   lease ends, before it frees the lease's memory (transfer.leases); so finding the lease's nonce there means
   the memory was neither freed nor reused while the reads ran, and the bytes are good. The nonce is a MAC of
   the lease id and the regions read, keyed by the lease token (`LeaseCheck.of`): only a puller with the token
   that read exactly the lease's regions can match it. Anything else (the lease ended: pulled, released,
   expired; a wrong token; another lease's regions) fails the pull as refused; its bytes are never used.
3. The puller sends a done notice: the lease ends as pulled and the held memory is freed. A puller that gives
   up (cancelled, past its deadline) sends an abandon notice instead, and the lease ends as aborted.

Why this shape: the holder's event loop is off the pull's path entirely (it shares the GIL with the prefill
engine and wakes up slowly: its answer to a claim used to be the longest part of a small pull), and nothing
but the data and one word crosses before the bytes count. Everything is bounded by a deadline. Buffers are 1-D
uint8 tensors (CPU or CUDA); UCX reads CUDA memory with cuda_ipc / NVLink on a GPU host, no host staging, and
the lease word (host memory) over CMA or shared memory on one host. The UCX worker is progressed by the event
loop (transfer.loop_worker).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import struct
import time
from collections import deque
from dataclasses import dataclass

import structlog
import torch

from transfer import failpoints, loop_worker
from transfer.leases import Lease, LeaseTable, lease_nonce

log = structlog.get_logger("deltamesh.transfer")

NOTICE_TAG = 0x646D_7368_0000_0001  # "dmsh" + 1: where holders receive the pullers' notices
_MAX_NOTICE_BYTES = 1 << 12
_LEN = struct.Struct("<I")


class TransferError(RuntimeError):
    """A pull failed; `refused` is true when the holder refused it before moving bytes."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


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


@dataclass
class TransferStats:
    nbytes: int
    buffers: int  # reads on the wire (segments)
    # perf_counter() at each step of the pull ("start", "keys": endpoint and keys looked up, "posted": every read
    # posted, "reads": every read done, "done": the lease word checked); on Linux that clock is CLOCK_MONOTONIC,
    # shared by the processes of one host, so they line up with StateServer.timeline
    marks: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.marks["done"] - self.marks["start"]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


def configure_ucx(bind_host: str) -> None:
    """Must run before the UCX worker is created: when the side channel is bound to loopback, UCX may use
    only `lo` (by default it would open every network device it finds)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if _is_loopback(bind_host):
        os.environ["UCX_NET_DEVICES"] = "lo"


def shutdown_ucx() -> None:
    """Release this process's UCX worker once the side channel's endpoints are closed, so that another event
    loop (tests) can create a new one."""
    loop_worker.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _frame(msg) -> "object":
    import numpy as np

    body = msg.SerializeToString()
    return np.frombuffer(_LEN.pack(len(body)) + body, dtype=np.uint8)


def _unframe(buf, cls):
    (n,) = _LEN.unpack_from(buf, 0)
    msg = cls()
    msg.ParseFromString(bytes(buf[_LEN.size : _LEN.size + n]))
    return msg


class _Endpoints:
    """One UCX endpoint per peer worker address, reused across transfers, with the remote keys unpacked for it."""

    def __init__(self, error_handling: bool):
        self.error_handling = error_handling
        self._eps: dict[bytes, object] = {}
        self._rkeys: dict[bytes, dict[bytes, object]] = {}  # peer address -> packed key -> unpacked
        self._retired: list[tuple[object, dict]] = []  # (endpoint left open or None, its keys) until close()

    def get(self, address: bytes):
        ep = self._eps.get(address)
        if ep is None:
            ep = self._eps[address] = loop_worker.get().endpoint(address, self.error_handling)
        return ep

    def rkey(self, address: bytes, packed: bytes):
        """The peer's remote key, unpacked once per endpoint (a holder registers its pools once, so every lease
        from it carries the same few keys)."""
        from transfer import rma

        keys = self._rkeys.setdefault(address, {})
        key = keys.get(packed)
        if key is None:
            key = keys[packed] = rma.RemoteKey(self.get(address).handle, packed)
        return key

    def drop(self, address: bytes) -> None:
        """Close the endpoint to a peer (after a failure on it; UCX then ends what is still on it): the next
        transfer makes a new one."""
        self._retire(address, close=True)

    def forget(self, address: bytes) -> None:
        """Make a new endpoint next time, leaving this one to what is still on it (reads, a notice)."""
        self._retire(address, close=False)

    def _retire(self, address: bytes, close: bool) -> None:
        # A remote key may still be used by a read in flight: keys are destroyed only in close().
        ep = self._eps.pop(address, None)
        if close:
            _close(ep)
        self._retired.append((None if close else ep, self._rkeys.pop(address, {})))

    def close(self) -> None:
        for address in list(self._eps):
            self._retire(address, close=False)
        for ep, keys in self._retired:
            for key in keys.values():
                key.close()
            _close(ep)
        self._retired.clear()


def _close(ep) -> None:
    if ep is not None and ep.alive:
        try:
            ep.close()
        except Exception:  # already gone with its peer
            pass


def worker_address() -> bytes:
    """This process's UCX worker address (what peers connect to); starts UCX on first use."""
    return loop_worker.get().address


class StateServer:
    """Holder side (prefill): publishes where held state lives and where each lease's word is, and ends leases on
    the pullers' notices. It takes no part in a pull itself."""

    def __init__(self, leases: LeaseTable):
        self.leases = leases
        self._task: asyncio.Task | None = None
        self._registered: dict[tuple[int, int], object] = {}  # (start, bytes) of an allocation -> registration
        # the last notices: lease id and perf_counter() when the done notice arrived (see TransferStats.marks)
        self.timeline: deque[dict] = deque(maxlen=256)
        self.address = b""

    async def start(self) -> None:
        self.address = worker_address()
        self.words()  # registered before any lease points into it
        self._task = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for registration in self._registered.values():
            registration.close()
        self._registered.clear()

    def regions(self, buffers: list[torch.Tensor]) -> list[RemoteRegion]:
        """Where `buffers` (views of this worker's pools) can be read by a puller. The allocation behind each is
        registered with UCX on first use and stays registered: pools live as long as the worker."""
        out = []
        for b in buffers:
            storage = b.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
            registration = self._registered.get((start, size))
            if registration is None:
                registration = loop_worker.get().register(start, size, b.is_cuda)
                self._registered[(start, size)] = registration
            out.append(RemoteRegion(b.numel(), b.data_ptr(), registration.rkey))
        return out

    def words(self) -> RemoteRegion:
        """Where the lease words are (host memory): what a puller's warm-up reads besides the pools."""
        return self.regions([self.leases.words.view(torch.uint8)])[0]

    def lease_check(self, lease: Lease) -> LeaseCheck:
        """What a puller of `lease` reads after its data, and must find there."""
        words = self.words()
        return LeaseCheck(words.address + lease.word * self.leases.words.element_size(), words.rkey, lease.nonce)

    async def _serve(self) -> None:
        import numpy as np

        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        while True:
            buf = np.empty(_MAX_NOTICE_BYTES, dtype=np.uint8)
            try:
                await ucx.recv(buf, NOTICE_TAG, listening=True)
                received = time.perf_counter()
                notice = _unframe(buf, transfer_pb2.PullNotice)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # malformed or truncated: drop it, keep serving
                log.warning("bad pull notice", error=str(e))
                continue
            if not notice.lease_id:  # a puller's warm-up (StatePuller.warm)
                continue
            if not self.leases.finish(notice.lease_id, notice.token, pulled=notice.done):
                continue  # ended already (expired, released) or a wrong token
            if notice.done:
                self.timeline.append({"lease_id": notice.lease_id, "done": received})
            else:
                log.warning("pull abandoned by the puller", lease_id=notice.lease_id)


class StatePuller:
    """Puller side (decode): reads leased state straight into its own buffers."""

    def __init__(self, error_handling: bool = True, settle_grace_s: float = 10.0, spin_s: float = 0.02):
        """`spin_s`: how long a pull into GPU buffers may keep the event loop progressing UCX on every turn
        instead of waiting to be woken (see loop_worker); 0 never spins. Host pulls never spin: their bytes are
        copied by CPU cores, which spinning would take away."""
        self._eps = _Endpoints(error_handling)
        self.spin_s = spin_s
        self._notices: set[asyncio.Future] = set()  # done and abandon notices on their way
        # failed pulls whose reads may still write into their buffers: lease id -> resolves when they no longer can
        self._unsettled: dict[str, asyncio.Future] = {}
        self.settle_grace_s = settle_grace_s

    async def start(self) -> None:
        """Bring UCX up now (context and worker). Left to the first pull, that holds the GIL for a few hundred
        milliseconds (measured: ~0.45 s on a CPU host), stalling the engine's loop."""
        worker_address()

    async def close(self) -> None:
        if self._notices:
            await asyncio.wait(self._notices, timeout=1.0)
        self._eps.close()

    async def warm(self, holder_address: bytes, pools: list[RemoteRegion], words: RemoteRegion | None, device: torch.device,
                   timeout_s: float) -> float:  # fmt: skip
        """Do now, before the first request from a holder, what UCX sets up on the first pull from it: the
        endpoint, the remote keys, the first read of each of its pools into `device` memory (cuda_ipc opens the
        holder's allocations), of its lease words (StateServer.words) into host memory, and the first notice. UCX
        chooses its protocols for each kind of operation on first use: on the H200 pair the first notice's send
        alone took 60-72 ms, blocking the event loop, and stretched the decode step beside it as long. Returns the
        seconds taken; raises TransferError."""
        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                ep = self._eps.get(holder_address)
                reads = [(r, torch.empty(1, dtype=torch.uint8, device=device)) for r in pools]
                reads += [(words, torch.empty(8, dtype=torch.uint8))] if words else []
                await asyncio.gather(*(ucx.get(ep, into, r.address, self._eps.rkey(holder_address, r.rkey))
                                       for r, into in reads))  # fmt: skip
                await ucx.send(ep, _frame(transfer_pb2.PullNotice()), NOTICE_TAG)  # no lease id: the holder skips it
        except Exception as e:  # unreachable or gone: the first pull will find out again
            self._eps.drop(holder_address)
            raise TransferError(f"side-channel warm-up with a prefill worker failed: {e!r}") from e
        return time.perf_counter() - started

    def release_after(self, lease_id: str, release) -> None:
        """Call `release()` (give the failed pull's buffers back) once UCX can no longer write into them: a read
        already posted completes into its buffer whatever happened to the pull, and buffers reused by then would
        be overwritten silently. So: at once when no read was posted, else when the reads are done, and at the
        latest after `settle_grace_s` (a read that needs the holder's help, as over TCP, waits for a stalled
        holder)."""
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

    def _notify(self, ep, lease_id: str, token: bytes, **kind) -> None:
        """Fire and forget a done or abandon notice to the holder."""
        from deltamesh.v1 import transfer_pb2

        notice = loop_worker.get().send(ep, _frame(transfer_pb2.PullNotice(lease_id=lease_id, token=token, **kind)),
                                        NOTICE_TAG)  # fmt: skip
        self._notices.add(notice)
        notice.add_done_callback(self._notice_sent)

    def _notice_sent(self, notice: asyncio.Future) -> None:
        self._notices.discard(notice)
        if not notice.cancelled() and notice.exception():  # the holder is gone: its memory went with it
            log.info("pull notice not delivered", error=repr(notice.exception()))

    async def pull(
        self,
        holder_address: bytes,
        lease_id: str,
        token: bytes,
        check: LeaseCheck,
        holder_regions: list[RemoteRegion],
        buffers: list[torch.Tensor],
        timeout_s: float,
    ) -> TransferStats:
        """Fill `buffers` with the leased state, or raise TransferError (the buffers are then undefined)."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):  # in this task: no extra task, no loop turn before the reads
                return await self._pull(holder_address, lease_id, token, check, holder_regions, buffers, started)
        except TimeoutError:
            self._eps.forget(holder_address)  # closing it would cancel the abandon notice just posted
            raise TransferError(f"state transfer for lease {lease_id!r} did not finish within {timeout_s:.1f}s") from None
        except TransferError:
            raise
        except Exception as e:  # UCX errors: the holder is unreachable or went away mid-transfer
            self._eps.drop(holder_address)
            raise TransferError(f"state transfer for lease {lease_id!r} failed: {e!r}") from e

    async def _pull(self, address, lease_id, token, check: LeaseCheck, regions, buffers, started) -> TransferStats:
        ucx = loop_worker.get()
        plan = segments([r.nbytes for r in regions], [b.numel() for b in buffers])
        spin_s = self.spin_s if buffers and buffers[0].is_cuda else 0.0
        ep = None
        reads: list[asyncio.Future] = []
        try:
            ep = self._eps.get(address)
            keys = [self._eps.rkey(address, r.rkey) for r in regions]  # unpacked once per peer; a bad one fails here
            keyed = time.perf_counter()
            reads = [
                ucx.get(ep, buffers[j][dst_off : dst_off + n], regions[i].address + src_off, keys[i], spin_s=spin_s)
                for i, src_off, j, dst_off, n in plan
            ]
            posted = time.perf_counter()
            word_key = self._eps.rkey(address, check.rkey)  # while the reads run
            word = torch.empty(8, dtype=torch.uint8)  # what the check reads into
            for r in reversed(reads):  # the last posted is usually done last: one wake-up, where gather costs two
                await r
            read = time.perf_counter()
            await failpoints.hit("transfer.before_check")
            # Only now, with every read complete: the lease word still holding the nonce means the lease had not
            # ended, so its memory had not been freed or reused, while they ran.
            await ucx.get(ep, word, check.address, word_key, spin_s=spin_s)
            if int.from_bytes(word.numpy().tobytes(), "little") != check.nonce:
                raise TransferError(f"lease {lease_id!r} ended before its state was read (pulled, released or "
                                    "expired), or the token or regions are not the lease's: the bytes read are not "
                                    "used", refused=True)  # fmt: skip
        except BaseException as e:
            for f in reads:
                f.cancel()
            if reads:  # posted reads still land in the buffers: they are free again once those are done
                self._unsettled[lease_id] = ucx.settled(reads)
            if reads and not (isinstance(e, TransferError) and e.refused):
                self._notify(ep, lease_id, token, abandon=True)  # the holder frees the state now
            raise
        done = time.perf_counter()
        self._notify(ep, lease_id, token, done=True)
        marks = {"start": started, "keys": keyed, "posted": posted, "reads": read, "done": done}
        return TransferStats(sum(n for *_, n in plan), len(plan), marks)

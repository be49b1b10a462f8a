"""The UCX side channel (ucxx + UCX RMA) that moves a request's state from a prefill worker to a decode worker.

No listening socket: each side publishes its UCX *worker address* through the gRPC control plane. The holder
(prefill) registers its pools with UCX once; with each lease it hands out, through the control plane, where
the held regions are and the remote keys to read them (`StateServer.regions`). A pull goes:

1. The puller (decode) sends a `PullRequest` (lease id, token, compatibility hash, its address, a reply tag)
   to the holder's well-known request tag and, without waiting, reads every region straight into its own
   buffers (one RMA get per segment, zero-copy at both ends).
2. The holder checks the lease and answers `PullStatus`; an accepted lease can no longer expire. The bytes
   read count only if the answer is ok: the lease was alive when the claim arrived, so its memory had not
   been reused while the reads ran before it, and cannot be after.
3. The puller sends a done notice once its reads completed: the lease ends as pulled and the held memory is
   freed. A puller that gives up (cancelled, past its deadline) sends an abandon notice instead.

Why this shape: the request round trip overlaps the data instead of preceding it, and the holder's event loop
is off the data path. Everything is bounded by a deadline. Buffers are 1-D uint8 tensors (CPU or CUDA); UCX
reads CUDA memory with cuda_ipc / NVLink on a GPU host, no host staging. The UCX worker is progressed by the
event loop (transfer.loop_worker).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import struct
import time
from collections import deque
from dataclasses import dataclass

import structlog
import torch

from transfer import failpoints, loop_worker
from transfer.leases import LeaseRefused, LeaseTable

log = structlog.get_logger("deltamesh.transfer")

REQUEST_TAG = 0x646D_7368_0000_0001  # "dmsh" + 1: where holders receive pull requests and notices
_MAX_REQUEST_BYTES = 1 << 16
_LEN = struct.Struct("<I")


class TransferError(RuntimeError):
    """A pull failed; `refused` is true when the holder refused it before moving bytes."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class Region:
    """One held region as a puller reads it: its size, where it starts in the holder's memory, and the
    packed UCX remote key of the registered memory around it."""

    nbytes: int
    address: int
    rkey: bytes


@dataclass
class TransferStats:
    nbytes: int
    buffers: int  # reads on the wire (segments)
    # perf_counter() at each step of the pull ("start", "request", "status", "reads": the last read seen done,
    # "done"); on Linux that clock is CLOCK_MONOTONIC, shared by the processes of one host, so they line up
    # with StateServer.timeline
    marks: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.marks["done"] - self.marks["start"]

    @property
    def status_seconds(self) -> float:
        """Until the holder's status arrived: the control round trip."""
        return self.marks["status"] - self.marks["start"]

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
    if ep is not None:
        try:
            ep.close()
        except Exception:  # already gone with its peer
            pass


def worker_address() -> bytes:
    """This process's UCX worker address (what peers connect to); starts UCX on first use."""
    return loop_worker.get().address


class StateServer:
    """Holder side (prefill): publishes where held state lives and answers claims on leases."""

    def __init__(self, leases: LeaseTable, error_handling: bool = True, send_timeout_s: float = 30.0):
        """`send_timeout_s`: how long an accepted claim may take to be read; then the lease ends as aborted."""
        self.leases = leases
        self.send_timeout_s = send_timeout_s
        self._eps = _Endpoints(error_handling)
        self._task: asyncio.Task | None = None
        self._pulls: set[asyncio.Task] = set()
        # lease id -> (token, task, future the done notice resolves) of the claims under way
        self._claims: dict[str, tuple[bytes, asyncio.Task, asyncio.Future]] = {}
        self._registered: dict[tuple[int, int], object] = {}  # (start, bytes) of an allocation -> registration
        # the last claims answered: lease id and perf_counter() when the claim arrived, the status was posted and
        # the done notice arrived (see TransferStats.marks)
        self.timeline: deque[dict] = deque(maxlen=256)
        self.address = b""

    async def start(self) -> None:
        self.address = worker_address()
        self._task = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        for t in [self._task, *self._pulls]:
            if t:
                t.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._pulls] if t), return_exceptions=True)
        self._eps.close()
        for registration in self._registered.values():
            registration.close()
        self._registered.clear()

    def regions(self, buffers: list[torch.Tensor]) -> list[Region]:
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
            out.append(Region(b.numel(), b.data_ptr(), registration.rkey))
        return out

    async def _serve(self) -> None:
        import numpy as np

        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        while True:
            buf = np.empty(_MAX_REQUEST_BYTES, dtype=np.uint8)
            try:
                await ucx.recv(buf, REQUEST_TAG, listening=True)
                received = time.perf_counter()
                req = _unframe(buf, transfer_pb2.PullRequest)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # malformed or truncated request: drop it, keep serving
                log.warning("bad pull request", error=str(e))
                continue
            if req.abandon or req.done:
                self._notice(req)
                continue
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            task = _start_task(loop, self._answer(req, received, done))
            if task.done():  # answered and over at once (refused)
                continue
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)
            # registered before the next message is read, so a notice right behind the claim finds it
            self._claims.setdefault(req.lease_id, (req.token, task, done))

    def _notice(self, req) -> None:
        """The puller has read everything (done) or gave up (abandon): the lease ends now, as pulled or aborted,
        instead of at the claim's deadline."""
        token, task, done = self._claims.get(req.lease_id, (b"", None, None))
        if task is None or not secrets.compare_digest(token, req.token):
            return
        if req.done:
            if not done.done():
                done.set_result(time.perf_counter())
        else:
            log.warning("pull abandoned by the puller", lease_id=req.lease_id)
            task.cancel()

    async def _answer(self, req, received: float, done: asyncio.Future) -> None:
        try:
            await self._answer_claim(req, received, done)
        finally:
            if self._claims.get(req.lease_id, (b"", None, None))[1] is asyncio.current_task():
                del self._claims[req.lease_id]

    async def _answer_claim(self, req, received: float, done: asyncio.Future) -> None:
        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        try:
            ep = self._eps.get(req.reply_address)
        except Exception as e:
            log.warning("cannot reach puller", lease_id=req.lease_id, error=str(e))
            return
        try:
            lease = self.leases.take(req.lease_id, req.token, req.compat_hash)
        except LeaseRefused as e:
            log.warning("pull refused", lease_id=req.lease_id, reason=str(e))
            status = transfer_pb2.PullStatus(ok=False, error=str(e))
            try:
                await asyncio.wait_for(ucx.send(ep, _frame(status), req.reply_tag), self.send_timeout_s)
            except Exception as e:
                self._eps.forget(req.reply_address)
                log.warning("cannot answer puller", lease_id=req.lease_id, error=repr(e))
            return
        ok, status_sent = False, None
        try:
            await failpoints.hit("transfer.before_status")
            status_sent = ucx.send(ep, _frame(transfer_pb2.PullStatus(ok=True)), req.reply_tag)
            posted = time.perf_counter()
            # The puller reads on its own; its done notice ends the lease. The held memory stays put until then.
            done_at = await asyncio.wait_for(_both(status_sent, done), self.send_timeout_s)
            ok = True
            self.timeline.append({"lease_id": req.lease_id, "received": received, "posted": posted, "done": done_at})
            log.info("state pulled", lease_id=req.lease_id, bytes=lease.nbytes, buffers=len(lease.buffers),
                     seconds=round(done_at - received, 6))  # fmt: skip
        except Exception as e:
            self._eps.drop(req.reply_address)
            log.warning("pull failed at the holder", lease_id=req.lease_id, error=repr(e))
        finally:
            if status_sent is not None:
                status_sent.cancel()
            self.leases.finish_pull(req.lease_id, ok)


def _start_task(loop: asyncio.AbstractEventLoop, coro) -> asyncio.Task:
    """A task that runs up to its first wait now (Python 3.12+), not a loop turn later: a claim's status leaves
    while the puller's reads run, so every turn before it is on the pull's critical path."""
    eager = getattr(asyncio, "eager_task_factory", None)
    return eager(loop, coro) if eager else loop.create_task(coro)


async def _both(sent: asyncio.Future, done: asyncio.Future):
    """The done notice's time, once the status has left too (a failed status send raises)."""
    await sent
    return await done


class StatePuller:
    """Puller side (decode): reads leased state straight into its own buffers."""

    def __init__(self, error_handling: bool = True, settle_grace_s: float = 10.0, spin_s: float = 0.02):
        """`spin_s`: how long a pull into GPU buffers may keep the event loop progressing UCX on every turn
        instead of waiting to be woken (see loop_worker); 0 never spins. Host pulls never spin: their bytes are
        copied by CPU cores, which spinning would take away."""
        self._eps = _Endpoints(error_handling)
        self.spin_s = spin_s
        self._address = b""  # this worker's UCX address, sent with every pull
        self._notices: set[asyncio.Future] = set()  # done and abandon notices on their way
        # failed pulls whose reads may still write into their buffers: lease id -> resolves when they no longer can
        self._unsettled: dict[str, asyncio.Future] = {}
        self.settle_grace_s = settle_grace_s

    async def start(self) -> None:
        """Bring UCX up now (context and worker). Left to the first pull, that holds the GIL for a few hundred
        milliseconds (measured: ~0.45 s on a CPU host), stalling the engine's loop."""
        self._address = worker_address()

    async def close(self) -> None:
        if self._notices:
            await asyncio.wait(self._notices, timeout=1.0)
        self._eps.close()

    async def warm(self, holder_address: bytes, regions: list[Region], device: torch.device, timeout_s: float) -> float:
        """Read the first byte of each of a holder's regions now, so that what UCX sets up on the first read from a
        peer happens before the first request from it, not inside that request's pull: on the H200 pair, cuda_ipc
        opening the holder's pool allocations made a first pull take 110-150 ms and stalled one decode step by
        55-68 ms. Returns the seconds taken; raises TransferError."""
        ucx = loop_worker.get()
        scratch = torch.empty(len(regions), dtype=torch.uint8, device=device)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                ep = self._eps.get(holder_address)
                keys = [self._eps.rkey(holder_address, r.rkey) for r in regions]
                await asyncio.gather(*(ucx.get(ep, scratch[i : i + 1], r.address, key) for i, (r, key)
                                       in enumerate(zip(regions, keys))))  # fmt: skip
        except Exception as e:  # unreachable or gone: the first pull will find out again
            self._eps.drop(holder_address)
            raise TransferError(f"warm-up read from a prefill worker failed: {e!r}") from e
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

        notice = loop_worker.get().send(ep, _frame(transfer_pb2.PullRequest(lease_id=lease_id, token=token, **kind)),
                                        REQUEST_TAG)  # fmt: skip
        self._notices.add(notice)
        notice.add_done_callback(self._notices.discard)

    async def pull(
        self,
        holder_address: bytes,
        lease_id: str,
        token: bytes,
        compat_hash: str,
        holder_regions: list[Region],
        buffers: list[torch.Tensor],
        timeout_s: float,
    ) -> TransferStats:
        """Fill `buffers` with the leased state, or raise TransferError (the buffers are then undefined)."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):  # in this task: no extra task, no loop turn before the claim
                return await self._pull(holder_address, lease_id, token, compat_hash, holder_regions, buffers, started)
        except TimeoutError:
            self._eps.forget(holder_address)  # closing it would cancel the abandon notice just posted
            raise TransferError(f"state transfer for lease {lease_id!r} did not finish within {timeout_s:.1f}s") from None
        except TransferError:
            raise
        except Exception as e:  # UCX errors: the holder is unreachable or went away mid-transfer
            self._eps.drop(holder_address)
            raise TransferError(f"state transfer for lease {lease_id!r} failed: {e!r}") from e

    async def _pull(self, address, lease_id, token, compat_hash, regions, buffers, started) -> TransferStats:
        import numpy as np

        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        plan = segments([r.nbytes for r in regions], [b.numel() for b in buffers])
        self._address = self._address or worker_address()
        spin_s = self.spin_s if buffers and buffers[0].is_cuda else 0.0
        reply_tag = secrets.randbits(63)
        ep = sent = status_rx = None
        reads: list[asyncio.Future] = []
        try:
            ep = self._eps.get(address)
            keys = [self._eps.rkey(address, r.rkey) for r in regions]  # unpacked once per peer; a bad one fails here
            claim = transfer_pb2.PullRequest(
                lease_id=lease_id, token=token, compat_hash=compat_hash, reply_tag=reply_tag, reply_address=self._address,
            )  # fmt: skip
            requested = time.perf_counter()
            # The claim leaves first: the holder's answer is the pull's longest path. The answer is small (eager):
            # should it come before its receive is posted, UCX keeps it as an unexpected message until then.
            sent = ucx.send(ep, _frame(claim), REQUEST_TAG)
            status_buf = np.empty(4096, dtype=np.uint8)
            status_rx = ucx.recv(status_buf, reply_tag, spin_s=spin_s)
            reads = [
                ucx.get(ep, buffers[j][dst_off : dst_off + n], regions[i].address + src_off, keys[i], spin_s=spin_s)
                for i, src_off, j, dst_off, n in plan
            ]
            read_marks: list[float] = []  # when each read was seen done: is a pull bound by the claim or the reads?
            for read in reads:
                read.add_done_callback(lambda _: read_marks.append(time.perf_counter()))
            # Wait for the answer, or for the claim to fail; not for the claim's completion first (one wake-up of
            # the event loop fewer on the critical path).
            await asyncio.wait((sent, status_rx), return_when=asyncio.FIRST_EXCEPTION)
            if sent.done():
                sent.result()
            status_rx.result()  # raises if the receive failed
            status_at = time.perf_counter()
            status = _unframe(status_buf, transfer_pb2.PullStatus)
            if not status.ok:
                raise TransferError(f"holder refused the pull: {status.error}", refused=True)
            await asyncio.gather(sent, *reads)
        except BaseException as e:
            for f in (status_rx, sent, *reads):
                if f is not None:
                    f.cancel()
            if reads:  # posted reads still land in the buffers: they are free again once those are done
                self._unsettled[lease_id] = ucx.settled(reads)
            if sent is not None and not (isinstance(e, TransferError) and e.refused):
                self._notify(ep, lease_id, token, abandon=True)  # the holder frees the state now
            raise
        done = time.perf_counter()
        self._notify(ep, lease_id, token, done=True)
        marks = {"start": started, "request": requested, "status": status_at, "reads": max(read_marks, default=done),
                 "done": done}  # fmt: skip
        return TransferStats(sum(n for *_, n in plan), len(plan), marks)

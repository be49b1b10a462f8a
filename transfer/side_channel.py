"""The UCX side channel (ucxx) that moves a request's state from a prefill worker to a decode worker.

No listening socket: each side publishes its UCX *worker address* through the gRPC control plane, and
messages are tagged. A pull goes:

1. The puller (decode) computes how the holder's regions and its own split into common segments, posts a
   receive for every segment straight into its own buffers, then sends a `PullRequest` (lease id, token,
   compatibility hash, its address, a reply tag) to the holder's well-known request tag.
2. The holder (prefill) checks the lease before touching any byte, replies `PullStatus`, and on success
   sends it together with every segment, zero-copy from its pools. Send completion is the
   acknowledgement: the lease is then ended and the held memory freed.
3. A puller that gives up (cancelled, or past its deadline) sends an abandon notice for the lease; the
   holder cancels its sends and frees the state at once.

Everything is bounded by a deadline. Buffers are 1-D uint8 tensors (CPU or CUDA); CUDA tensors go through
`__cuda_array_interface__`, so UCX picks cuda_ipc / NVLink on a GPU host with no host staging. The UCX worker
is progressed by the event loop (transfer.loop_worker).
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

REQUEST_TAG = 0x646D_7368_0000_0001  # "dmsh" + 1: where holders receive pull requests
# A pull's tags: status on reply_tag, segment k on reply_tag + 1 + k, the abandon acknowledgement last.
_TAGS_PER_PULL = 1 << 20
_ACK_OFFSET = _TAGS_PER_PULL - 1
_MAX_REQUEST_BYTES = 1 << 16
_LEN = struct.Struct("<I")


class TransferError(RuntimeError):
    """A pull failed; `refused` is true when the holder refused it before moving bytes."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


@dataclass
class TransferStats:
    nbytes: int
    buffers: int  # messages on the wire (segments)
    # perf_counter() at each step of the pull ("start", "request", "status", "done"); on Linux that clock is
    # CLOCK_MONOTONIC, shared by the processes of one host, so they line up with StateServer.timeline
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


def _ucx_buffer(t: torch.Tensor):
    """What ucxx accepts: numpy for host memory, the tensor itself (CUDA array interface) on a GPU."""
    return t if t.is_cuda else t.numpy()


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
    """One UCX endpoint per peer worker address, reused across transfers."""

    def __init__(self, error_handling: bool):
        self.error_handling = error_handling
        self._eps: dict[bytes, object] = {}

    def get(self, address: bytes):
        ep = self._eps.get(address)
        if ep is None:
            ep = self._eps[address] = loop_worker.get().endpoint(address, self.error_handling)
        return ep

    def drop(self, address: bytes) -> None:
        """Forget and close the endpoint to a peer (after a failure on it): the next transfer makes a new one."""
        _close(self._eps.pop(address, None))

    def forget(self, address: bytes) -> None:
        """Make a new endpoint next time, leaving this one to the messages still on it (an abandon notice)."""
        self._eps.pop(address, None)

    def close(self) -> None:
        for ep in self._eps.values():
            _close(ep)
        self._eps.clear()


def _close(ep) -> None:
    if ep is not None:
        try:
            ep.close()
        except Exception:  # already gone with its peer
            pass


def _first_of(*futures: asyncio.Future) -> asyncio.Future:
    """Resolves when any of `futures` succeeds."""
    first = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future) -> None:
        if not (first.done() or f.cancelled() or f.exception()):
            first.set_result(None)

    for f in futures:
        f.add_done_callback(done)
    return first


def worker_address() -> bytes:
    """This process's UCX worker address (what peers connect to); starts UCX on first use."""
    return loop_worker.get().address


class StateServer:
    """Holder side (prefill): answers pulls of leased state."""

    def __init__(self, leases: LeaseTable, error_handling: bool = True, send_timeout_s: float = 30.0):
        self.leases = leases
        self.send_timeout_s = send_timeout_s
        self._eps = _Endpoints(error_handling)
        self._task: asyncio.Task | None = None
        self._pulls: set[asyncio.Task] = set()
        # lease id -> (token, task, its posted sends) of the pulls under way
        self._sending: dict[str, tuple[bytes, asyncio.Task, list]] = {}
        # the last pulls answered: lease id and perf_counter() when the request arrived, the sends were posted and
        # completed (see TransferStats.marks)
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
            if req.abandon:
                self._abandon(req)
                continue
            sends: list[asyncio.Future] = []
            task = asyncio.create_task(self._answer(req, received, sends))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)
            # registered before the next message is read, so an abandon right behind the request finds it
            self._sending.setdefault(req.lease_id, (req.token, task, sends))

    def _abandon(self, req) -> None:
        """The puller gave up: stop answering (the lease then ends as aborted and frees its memory) and, once
        what was already posted is done, tell the puller that nothing more of this pull will reach it."""
        token, task, sends = self._sending.get(req.lease_id, (b"", None, []))
        if task is not None:
            if not secrets.compare_digest(token, req.token):
                return
            log.warning("pull abandoned by the puller", lease_id=req.lease_id)
            task.cancel()
        if req.reply_address:
            ack = asyncio.ensure_future(self._acknowledge_abandon(req, loop_worker.get().settled(sends)))
            self._pulls.add(ack)
            ack.add_done_callback(self._pulls.discard)

    async def _acknowledge_abandon(self, req, settled: asyncio.Future) -> None:
        from deltamesh.v1 import transfer_pb2

        await settled  # UCX is done with every send of this pull already posted (sent, or failed)
        status = transfer_pb2.PullStatus(ok=False, error="abandoned")
        try:
            ep = self._eps.get(req.reply_address)
            await asyncio.wait_for(loop_worker.get().send(ep, _frame(status), req.reply_tag + _ACK_OFFSET),
                                   self.send_timeout_s)  # fmt: skip
        except Exception as e:  # the puller is gone: nobody left to tell
            log.debug("cannot acknowledge an abandoned pull", lease_id=req.lease_id, error=repr(e))

    async def _answer(self, req, received: float, sends: list) -> None:
        try:
            await self._answer_pull(req, received, sends)
        finally:
            if self._sending.get(req.lease_id, (b"", None, []))[1] is asyncio.current_task():
                del self._sending[req.lease_id]

    async def _answer_pull(self, req, received: float, pending: list) -> None:
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
            await self._send_status(ep, req, transfer_pb2.PullStatus(ok=False, error=str(e)))
            return
        ok = False
        try:
            sizes = [b.numel() for b in lease.buffers]
            try:
                plan = segments(sizes, list(req.region_bytes))
            except TransferError as e:
                await self._send_status(ep, req, transfer_pb2.PullStatus(ok=False, error=str(e)))
                return
            # The status goes out with the data, not before it: each awaited completion costs a wake-up of this
            # event loop, and the puller has posted every receive before asking.
            pending.append(ucx.send(ep, _frame(transfer_pb2.PullStatus(ok=True, num_segments=len(plan))), req.reply_tag))
            await failpoints.hit("transfer.after_status")
            # No stream sync needed: the engine synchronised when it sampled the first token, after the
            # kernels that wrote this state.
            pending.extend(
                ucx.send(ep, _ucx_buffer(lease.buffers[i][off : off + n]), req.reply_tag + 1 + k)
                for k, (i, off, _, _, n) in enumerate(plan)
            )
            posted = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*pending), self.send_timeout_s)
            ok = True
            sent = time.perf_counter()
            self.timeline.append({"lease_id": req.lease_id, "received": received, "posted": posted, "sent": sent})
            log.info("state sent", lease_id=req.lease_id, bytes=lease.nbytes, buffers=len(plan),
                     seconds=round(sent - received, 6))  # fmt: skip
        except Exception as e:
            self._eps.drop(req.reply_address)  # also cancels what UCX still has in flight to this puller
            log.warning("state send failed", lease_id=req.lease_id, error=repr(e))
        finally:
            for f in pending:
                f.cancel()
            self.leases.finish_pull(req.lease_id, ok)

    async def _send_status(self, ep, req, status) -> None:
        try:
            await asyncio.wait_for(loop_worker.get().send(ep, _frame(status), req.reply_tag), self.send_timeout_s)
        except Exception as e:
            self._eps.forget(req.reply_address)
            log.warning("cannot answer puller", lease_id=req.lease_id, error=repr(e))


class StatePuller:
    """Puller side (decode): receives leased state straight into its own buffers."""

    def __init__(self, error_handling: bool = True, settle_grace_s: float = 10.0, spin_s: float = 0.02):
        """`spin_s`: how long a pull into GPU buffers may keep the event loop progressing UCX on every turn
        instead of waiting to be woken (see loop_worker); 0 never spins. Host pulls never spin: their bytes are
        copied by CPU cores, which spinning would take away."""
        self._eps = _Endpoints(error_handling)
        self.spin_s = spin_s
        self._address = b""  # this worker's UCX address, sent with every pull
        self._notices: set[asyncio.Future] = set()  # abandon notices on their way
        # failed pulls whose receives UCX may still fill: lease id -> resolves when it no longer can
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

    def release_after(self, lease_id: str, release) -> None:
        """Call `release()` (give the failed pull's buffers back) once UCX can no longer write into them. A
        holder that had already posted its sends when the puller gave up still completes them into the posted
        receives, and buffers reused by then would be overwritten silently. So: at once when the request never
        left or the holder refused; else when those receives complete or the holder acknowledges the abandon
        notice, and at the latest after `settle_grace_s` (a holder that never answers is gone or stalled)."""
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

    def _tell_abandoned(self, ep, lease_id: str, token: bytes, reply_tag: int) -> asyncio.Future:
        """Let the holder stop sending and free the state now rather than at its send deadline. Fire and
        forget: this runs while the pull is being cancelled. Returns what ends the wait for the buffers: the
        holder's acknowledgement (nothing of this pull can reach them any more), or the notice failing to leave
        (the holder is gone, as UCX reports with peer error handling on)."""
        import numpy as np

        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        acked = ucx.recv(np.empty(4096, dtype=np.uint8), reply_tag + _ACK_OFFSET, listening=True)
        notice = ucx.send(ep, _frame(transfer_pb2.PullRequest(
            lease_id=lease_id, token=token, abandon=True, reply_tag=reply_tag, reply_address=self._address,
        )), REQUEST_TAG)  # fmt: skip
        gone = asyncio.get_running_loop().create_future()

        def sent(t: asyncio.Future) -> None:
            self._notices.discard(t)
            if (t.cancelled() or t.exception()) and not gone.done():
                gone.set_result(None)

        self._notices.add(notice)
        notice.add_done_callback(sent)
        return _first_of(acked, gone)

    async def pull(
        self,
        holder_address: bytes,
        lease_id: str,
        token: bytes,
        compat_hash: str,
        holder_region_bytes: list[int],
        buffers: list[torch.Tensor],
        timeout_s: float,
    ) -> TransferStats:
        """Fill `buffers` with the leased state, or raise TransferError (the buffers are then undefined)."""
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(
                self._pull(holder_address, lease_id, token, compat_hash, holder_region_bytes, buffers, started),
                timeout_s,
            )
        except asyncio.TimeoutError:
            self._eps.forget(holder_address)  # closing it would cancel the abandon notice just posted
            raise TransferError(f"state transfer for lease {lease_id!r} did not finish within {timeout_s:.1f}s") from None
        except TransferError:
            raise
        except Exception as e:  # UCX errors: the holder is unreachable or went away mid-transfer
            self._eps.drop(holder_address)
            raise TransferError(f"state transfer for lease {lease_id!r} failed: {e!r}") from e

    async def _pull(self, address, lease_id, token, compat_hash, holder_sizes, buffers, started) -> TransferStats:
        import numpy as np

        from deltamesh.v1 import transfer_pb2

        ucx = loop_worker.get()
        plan = segments(list(holder_sizes), [b.numel() for b in buffers])
        self._address = self._address or worker_address()
        reply_tag = secrets.randbits(40) * _TAGS_PER_PULL
        if len(plan) > _ACK_OFFSET - 1:
            raise TransferError(f"{len(plan)} segments is too many for one pull")
        spin_s = self.spin_s if buffers and buffers[0].is_cuda else 0.0
        status_buf = np.empty(4096, dtype=np.uint8)
        status_rx = ucx.recv(status_buf, reply_tag, spin_s=spin_s)
        data_rx = [
            ucx.recv(_ucx_buffer(buffers[j][off : off + n]), reply_tag + 1 + k, spin_s=spin_s)
            for k, (_, _, j, off, n) in enumerate(plan)
        ]
        ep = sent = None
        try:
            ep = self._eps.get(address)
            request = transfer_pb2.PullRequest(
                lease_id=lease_id, token=token, compat_hash=compat_hash, reply_tag=reply_tag,
                reply_address=self._address, region_bytes=[b.numel() for b in buffers],
            )  # fmt: skip
            requested = time.perf_counter()
            sent = ucx.send(ep, _frame(request), REQUEST_TAG)
            # Wait for the answer, or for the request to fail; not for the request's completion first (one
            # wake-up of the event loop fewer on the critical path).
            await asyncio.wait((sent, status_rx), return_when=asyncio.FIRST_EXCEPTION)
            if sent.done():
                sent.result()
            status_rx.result()  # raises if the receive failed
            status_at = time.perf_counter()
            status = _unframe(status_buf, transfer_pb2.PullStatus)
            if not status.ok:
                raise TransferError(f"holder refused the pull: {status.error}", refused=True)
            await asyncio.gather(sent, *data_rx)
        except BaseException as e:
            for f in (status_rx, *data_rx, sent):
                if f is not None:
                    f.cancel()
            if sent is not None and not (isinstance(e, TransferError) and e.refused):
                # the holder may have posted sends that still land here: the buffers are free again once the
                # receives are done or the holder acknowledges the abandon (release_after)
                acked = self._tell_abandoned(ep, lease_id, token, reply_tag)
                self._unsettled[lease_id] = _first_of(ucx.settled(data_rx), acked)
            raise
        done = time.perf_counter()
        marks = {"start": started, "request": requested, "status": status_at, "done": done}
        return TransferStats(sum(n for *_, n in plan), len(plan), marks)

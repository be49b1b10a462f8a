"""One UCX worker per process, progressed by the asyncio event loop itself.

ucxx's asyncio layer completes each request through two helper threads (a progress thread, then a Python
notifier thread that hands the result to the loop), and both need the GIL: each hand-over costs a large part of a
small pull, and more next to a busy engine thread. Here the worker's wake-up file descriptor sits in the loop's
own epoll set instead: when UCX has something to do (a message arrived, a GPU copy finished: cuda_ipc signals
through an eventfd) the loop wakes, progresses the worker and resolves the futures of the requests that
completed. No extra thread; nothing spins when idle.

A request may ask to be spun for (`spin_s`): until it completes, or for at most that long, the worker is
progressed on every turn of the loop instead of waiting for the wake-up, because an event-driven hand-over
costs more than UCX's own work for a transfer expected to finish within milliseconds. Other callbacks still
run between rounds.

All calls must come from the loop that created the worker (`get()`); `close()` releases it so that another
loop (tests) can create a new one.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltamesh.transfer.ucx.rma import Registration

# Progress now and then while requests are pending, in case a wake-up is ever missed (ucxx does the same, at
# 1 s): this bounds the damage to a delay, never a hang. Often while a transfer is under way, rarely while only
# a listening receive waits.
_SAFETY_PROGRESS_S = 0.005
_IDLE_PROGRESS_S = 1.0
_MAX_ROUNDS = 64  # progress rounds per wake-up before yielding to the loop's other callbacks

_worker: LoopWorker | None = None


def _spin_until(spin_s: float) -> float:
    return time.perf_counter() + spin_s if spin_s > 0 else 0.0


def get() -> LoopWorker:
    """This process's worker, created on first use on the running loop."""
    global _worker
    loop = asyncio.get_running_loop()
    if _worker is None:
        _worker = LoopWorker(loop)
    elif _worker.loop is not loop:
        raise RuntimeError("the UCX worker belongs to another event loop: close the UCX transport first")
    return _worker


def close() -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


class LoopWorker:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        from ucxx._lib import libucxx as ucx

        self._ucx = ucx
        self.loop = loop
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.RMA, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)  # no delayed submission, no Python futures: requests post at once
        self.worker.init_blocking_progress_mode()
        self._fd = self.worker.epoll_file_descriptor
        # UCX request (ucxx's, or rma.GetRequest) -> (caller's future, buffer, listening, spin until
        # this perf_counter())
        self._waiting: dict[Any, tuple] = {}  # ucxx's requests (an untyped module) -> what waits on them
        self._request_of: dict[asyncio.Future, object] = {}  # caller's future -> its UCX request, until done
        self._settle_waiters: list[tuple[set, asyncio.Future]] = []  # (requests not done yet, who waits)
        self._safety: asyncio.TimerHandle | None = None
        self._scheduled = False
        loop.add_reader(self._fd, self._progress)
        self.address: bytes = self.worker.address.tobytes()

    def endpoint(self, address: bytes, error_handling: bool):
        ucx = self._ucx
        return ucx.UCXEndpoint.create_from_worker_address(
            self.worker, ucx.UCXAddress.create_from_buffer(address), error_handling
        )

    def send(self, ep, buffer, tag: int) -> asyncio.Future:
        """Post a tagged send now; the future resolves when UCX is done with `buffer`."""
        from ucxx._lib.arr import Array

        array = Array(buffer)
        return self._track(ep.tag_send(array, self._ucx.UCXXTag(tag)), array)

    def recv(self, buffer, tag: int, listening: bool = False, spin_s: float = 0.0) -> asyncio.Future:
        """Post a tagged receive (any sender) now; the future resolves when `buffer` holds the message.
        `listening`: a receive that may wait for a long time (for requests), not part of a transfer.
        `spin_s`: progress the worker on every turn of the loop until this receive completes, at most this long."""
        from ucxx._lib.arr import Array

        array = Array(buffer)
        request = self.worker.tag_recv(array, self._ucx.UCXXTag(tag))
        return self._track(request, array, listening, _spin_until(spin_s))

    def get(self, ep, buffer, remote_address: int, rkey, spin_s: float = 0.0) -> asyncio.Future:
        """Read `buffer.numel()` bytes at `remote_address` of the peer (memory registered there, `rkey` unpacked
        for `ep`) into `buffer` (a 1-D uint8 tensor, host or CUDA); resolves when they are there."""
        from deltamesh.transfer.ucx import rma

        request = rma.GetRequest(
            ep.handle, buffer.data_ptr(), buffer.numel(), remote_address, rkey, rma.memory_type(buffer.is_cuda)
        )
        if spin_s > 0 and not buffer.is_cuda and not request.completed:
            self.worker.progress()  # a host read (over CMA: one syscall) is done now, without a loop turn
        return self._track(request, buffer, False, _spin_until(spin_s))

    def register(self, address: int, length: int, cuda: bool) -> Registration:
        """Register memory for peers' reads (see rma.Registration)."""
        from deltamesh.transfer.ucx import rma

        return rma.Registration(self.context.handle, address, length, rma.memory_type(cuda))

    def _track(self, request, array, listening: bool = False, spin_until: float = 0.0) -> asyncio.Future:
        future = self.loop.create_future()
        if request.completed:  # done while posted (an RMA read over CMA, a short send): no loop turn to wait for
            _resolve(future, request)
            return future
        # Until UCX completes the request it may write to or read from the buffer, so the buffer stays
        # referenced here even when the caller gave up (cancelled its future).
        self._waiting[request] = (future, array, listening, spin_until)
        self._request_of[future] = request
        self._schedule()  # a new request may need progress (a rendezvous) before any event arrives
        return future

    def settled(self, futures) -> asyncio.Future:
        """Resolves once UCX is done with the requests behind `futures`, even if those were cancelled: until
        then a posted receive can still be written into."""
        pending = {self._request_of[f] for f in futures if f in self._request_of}
        waiter = self.loop.create_future()
        if pending:
            self._settle_waiters.append((pending, waiter))
        else:
            waiter.set_result(None)
        return waiter

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._progress)

    def _progress(self) -> None:
        self._scheduled = False
        for _ in range(_MAX_ROUNDS):
            self.worker.progress()
            self._resolve_completed()
            # Spinning: no arm, the next turn progresses again. Arming is for sleeping, and it is not free while a
            # GPU copy runs: cuda_ipc then enqueues a host callback on every busy copy stream (to signal the fd).
            if self._spinning() or self.worker.arm():
                break
        else:  # still busy: let the loop's other callbacks run, then go on
            self._schedule()
        if self._safety is not None:
            self._safety.cancel()
            self._safety = None
        if not self._waiting:
            return
        if self._spinning():
            self._schedule()  # again on the loop's next turn
            return
        busy = any(not (listening or future.done()) for future, _, listening, _ in self._waiting.values())
        self._safety = self.loop.call_later(_SAFETY_PROGRESS_S if busy else _IDLE_PROGRESS_S, self._progress)

    def _spinning(self) -> bool:
        now = time.perf_counter()
        return any(until > now and not future.done() for future, _, _, until in self._waiting.values())

    def _resolve_completed(self) -> None:
        for request in [r for r in self._waiting if r.completed]:
            future, *_ = self._waiting.pop(request)
            self._request_of.pop(future, None)
            self._settle(request)
            _resolve(future, request)

    def _settle(self, request) -> None:
        if not self._settle_waiters:
            return
        for pending, waiter in self._settle_waiters:
            pending.discard(request)
            if not pending and not waiter.done():
                waiter.set_result(None)
        self._settle_waiters = [(p, w) for p, w in self._settle_waiters if p]

    def close(self) -> None:
        try:
            self.loop.remove_reader(self._fd)
        except Exception:  # the loop is already closed
            pass
        if self._safety is not None:
            self._safety.cancel()
        for future in [f for f, *_ in self._waiting.values()] + [w for _, w in self._settle_waiters]:
            if not future.done():
                future.cancel()
        self._waiting.clear()
        self._request_of.clear()
        self._settle_waiters.clear()


def _resolve(future: asyncio.Future, request) -> None:
    """A completed request's outcome, for whoever still waits on its future."""
    if future.done():
        return
    try:
        request.check_error()
    except Exception as e:  # the peer went away, the endpoint closed, the message was truncated
        future.set_exception(e)
    else:
        future.set_result(None)

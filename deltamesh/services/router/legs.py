"""The worker calls of a request's legs (prefill, decode or colocated, the reverse pull's offer, lease releases):
which worker, retries, and how a worker's failure reaches the client. `Mesh` strings them into a request."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from deltamesh.services.router import metrics
from deltamesh.services.router.feeds import Feeds, feed_error
from deltamesh.services.router.pd_decider import PdDecider
from deltamesh.services.router.policies import Policy
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2

log = structlog.get_logger("deltamesh.mesh")


class MeshError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class NotHeld(Exception):
    """A decode worker refused a direct request: its prefix cache does not hold the conversation (any more)."""


@dataclass
class Inflight:
    owner: bytes = b""  # what Abort must present (the nonce of the abort token; empty: only cancelling aborts it)
    call: Any = None  # the worker call in progress (a grpc.aio call: grpc ships no types)
    worker: WorkerHandle | None = None  # the decode (or colocated) worker that streams its tokens
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        if self.call is not None:
            self.call.cancel()


# A worker's own words reach the client only where they are about the request (its input, or no room for it now);
# any other failure is the mesh's: the client gets its status and a generic message, the log gets the worker's
# address and details.
_CLIENT_DETAILS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _worker_failure(code: grpc.StatusCode, leg: str, w: WorkerHandle, details: str, told: str = "") -> MeshError:
    """The error a client gets for a failed worker call (`told`: what to tell it instead of a generic message);
    the worker and its details are logged."""
    log.warning("worker call failed", leg=leg, worker=w.address, code=code.name, details=details)
    return MeshError(code, told or f"the request failed in the mesh ({leg} worker: {code.name}); retry it")


def _leg_error(e: grpc.aio.AioRpcError, leg: str, w: WorkerHandle) -> MeshError:
    return _worker_failure(e.code(), leg, w, e.details(), e.details() if e.code() in _CLIENT_DETAILS else "")


def _cancelled_call(inflight: Inflight, leg: str, w: WorkerHandle) -> MeshError:
    """A worker call was cancelled but not our task: an abort, or the call's channel went away. Anything but
    a silent end of the stream. (When our own task is being cancelled, the caller re-raises instead.)"""
    if inflight.aborted:
        return MeshError(grpc.StatusCode.CANCELLED, f"aborted during the {leg} call")
    return _worker_failure(grpc.StatusCode.UNAVAILABLE, leg, w, "call cancelled (connection closed)")


def _own_task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Legs:
    """Calls to the workers for one router: picks a worker per leg, retries a prefill (and a decode that has not
    streamed yet) on another worker when one is unavailable, and releases leases in the background."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        pd: PdDecider | None,
        prefill_retries: int,
        timeout_s: float,
    ):
        self.registry, self.policy, self.pd = registry, policy, pd
        self.prefill_retries, self.timeout_s = prefill_retries, timeout_s
        self._background: set[asyncio.Task] = set()
        self.feeds = Feeds(registry.call_metadata)  # the decode legs' token feeds, one per worker (feeds.py)

    def pick(self, role: str, exclude: set[str], prompt_ids=()) -> WorkerHandle:
        candidates = self.registry.pool(role, lambda w: w.address not in exclude)
        # decode workers cache nothing of a transferred prompt: only prefill and colocated picks see the prompt
        w = self.policy.pick(candidates, prompt_ids if role != "decode" else ())
        if w is None:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker is available")
        return w

    async def offer_prefix(self, prompt_ids: list[int]) -> tuple[WorkerHandle, prefill_pb2.PrefixSource] | None:
        """The reverse pull: the decode worker that holds the longest prefix of this prompt (a conversation it
        finished), asked to offer it to the prefill worker under a lease whose token is ours. None when no decode
        worker holds one, or it has nothing (evicted) or fails to answer: the prefill worker computes it all."""
        pd = self.pd
        assert pd is not None, "the reverse pull is the P/D decider's"
        holder, _ = pd.holder(self.registry.pool("decode"), prompt_ids)
        if holder is None:
            return None
        token = secrets.token_bytes(16)
        ask = decode_pb2.OfferPrefixRequest(prompt_token_ids=prompt_ids, lease_token=token, min_tokens=pd.held.block)
        try:
            offer = await holder.stub.OfferPrefix(ask, metadata=self.registry.call_metadata(), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("prefix offer failed", worker=holder.address, code=e.code().name, details=e.details())
            metrics.PD_DECISIONS.labels("offer_failed").inc()
            return None
        if not offer.HasField("lease"):
            metrics.PD_DECISIONS.labels("offer_none").inc()
            return None
        metrics.PD_DECISIONS.labels("offered").inc()
        return holder, prefill_pb2.PrefixSource(lease=offer.lease, layout=offer.layout, transport=offer.transport)

    async def prefill(self, req: prefill_pb2.PrefillRequest, inflight: Inflight):
        tried: set[str] = set()
        while True:
            w = self.pick("prefill", tried, req.prompt_token_ids)
            w.inflight += 1
            inflight.call = w.stub.Prefill(
                req, metadata=self.registry.call_metadata(req.request_id), timeout=self.timeout_s
            )
            try:
                return await inflight.call, w
            except asyncio.CancelledError:
                # an answer on its way is lost with the call (client gone, or an abort): end the lease it may
                # carry, whose token we chose
                self.release_later(w, common_pb2.Lease(lease_id=req.request_id, token=req.lease_token))
                if _own_task_cancelled():
                    raise
                raise _cancelled_call(inflight, "prefill", w) from None
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and not inflight.aborted:
                    self.registry.mark_failed(w, "prefill call unavailable")
                    tried.add(w.address)
                    if len(tried) <= self.prefill_retries:
                        metrics.RETRIES.labels("prefill").inc()
                        log.warning("retrying prefill on another worker", failed=w.address)
                        continue
                raise _leg_error(e, "prefill", w) from None
            finally:
                w.inflight -= 1
                inflight.call = None

    async def remembered(self, deltas, prompt_ids: list[int], inflight: Inflight, first=None):
        """`deltas`, and once they end normally, the whole sequence handed to the P/D decider as held by the
        decode worker that streamed them. `first`: the prefill worker's first token, already streamed."""
        tokens = list(first.token_ids) if first is not None else []
        async for delta in deltas:
            tokens += delta.token_ids
            if delta.finished and delta.finish_reason in (
                common_pb2.FINISH_REASON_STOP,
                common_pb2.FINISH_REASON_LENGTH,
            ):
                assert self.pd is not None and inflight.worker is not None, "remembered with a P/D decider, for a leg"
                self.pd.finished(inflight.worker.address, prompt_ids + tokens)
            yield delta

    async def decode(
        self,
        req: decode_pb2.DecodeRequest,
        role: str,
        inflight: Inflight,
        first_choice: WorkerHandle | None = None,
        holder: WorkerHandle | None = None,
    ):
        """`holder`: the prefill worker holding the state `req.source` leases, asked whether the lease lives before
        another decode worker retries a failed pull."""
        tried: set[str] = set()
        worker_failed = False  # a decode worker failed (not only a pull): the request's state may be used up
        again: WorkerHandle | None = None  # the same worker once more, without its feed (it did not know it)
        use_feed = True
        while True:
            if again is not None:
                w, again = again, None
            else:
                w = (
                    first_choice
                    if first_choice is not None and not tried
                    else self.pick(role, tried, req.prompt_token_ids)
                )
            inflight.worker = w
            w.inflight += 1  # before any wait: the picks of the requests arriving meanwhile count this one
            feed, key, inbox, call = None, 0, None, None
            streamed = finished = False
            try:
                feed = await self.feeds.of(w) if use_feed else None
                if inflight.aborted:  # while the feed was opened
                    raise _cancelled_call(inflight, role, w)
                if feed is not None:
                    key, inbox = feed.join()
                    req.feed_id, req.feed_key = feed.id, key
                    metrics.DECODE_CALLS.labels("feed").inc()
                else:
                    req.ClearField("feed_id")
                    req.ClearField("feed_key")
                    metrics.DECODE_CALLS.labels("stream").inc()
                call = inflight.call = w.stub.Decode(
                    req, metadata=self.registry.call_metadata(req.request_id), timeout=self.timeout_s
                )
                if inbox is None:
                    while (delta := await call.read()) is not grpc.aio.EOF:  # one async generator fewer per token
                        streamed = True
                        finished = delta.finished
                        yield delta
                else:
                    call.add_done_callback(inbox.put)  # its end (an error, or OK once its last delta is on the feed)
                    items, loop, delta_type = inbox.items, asyncio.get_running_loop(), common_pb2.TokenDelta
                    while not finished:
                        if not items:  # wait on the inbox's future: no coroutine made per token
                            waiter = inbox.waiter = loop.create_future()
                            await waiter
                            continue
                        item = items.popleft()
                        if item.__class__ is delta_type:
                            streamed = True
                            finished = item.finished
                            yield item
                        elif item is call:
                            # raises the call's error (as a broken stream would); OK: its last delta is on its way
                            await call.read()
                        else:
                            raise feed_error(item.code, item.details)
                if not finished:
                    raise _worker_failure(grpc.StatusCode.UNAVAILABLE, role, w, "stream ended early")
                return
            except asyncio.CancelledError:
                if _own_task_cancelled():
                    raise
                raise _cancelled_call(inflight, role, w) from None
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and feed is not None and not streamed:
                    # the worker's side of the feed closed before this request reached it (our reader learns it
                    # next): the same worker, on its own stream
                    log.warning("token feed not open on the worker; streaming on its own", worker=w.address)
                    again, use_feed = w, False
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE and not inflight.aborted:
                    self.registry.mark_failed(w, "decode call unavailable")
                    if self.pd is not None:
                        self.pd.forget(w.address)
                    tried.add(w.address)
                    worker_failed = True
                    if not streamed and len(tried) <= 1:
                        metrics.RETRIES.labels(role).inc()
                        log.warning("retrying decode on another worker", failed=w.address)
                        continue
                if e.code() == grpc.StatusCode.ABORTED and req.HasField("source") and not inflight.aborted:
                    # the pull failed (the prefill worker unreachable from there, its deadline, the lease refused):
                    # the transfer's failure, not the decode worker's, which stays in routing
                    log.warning("state transfer failed", worker=w.address, details=e.details())
                    tried.add(w.address)
                    if len(tried) <= 1 and await self._another_may_pull(role, tried, holder, req.source.lease):
                        metrics.RETRIES.labels(role).inc()
                        log.warning("retrying the state transfer on another decode worker", failed=w.address)
                        continue
                    raise MeshError(
                        grpc.StatusCode.UNAVAILABLE,
                        "a decode worker failed and the retry could not take over the request's state; retry it"
                        if worker_failed
                        else "the request's state could not be moved from its prefill worker to a decode worker "
                        "(state transfer failed); retry it",
                    ) from None
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and req.max_uncached_tokens and not streamed:
                    raise NotHeld() from None
                raise _leg_error(e, role, w) from None
            finally:
                w.inflight -= 1
                inflight.call = None
                if feed is not None:
                    feed.leave(key)
                if not finished and call is not None:
                    call.cancel()  # the client left or the stream broke: stop the worker's request

    async def _another_may_pull(
        self, role: str, tried: set[str], holder: WorkerHandle | None, lease: common_pb2.Lease
    ) -> bool:
        """Whether another decode worker can try the pull: one is healthy, and the prefill worker still holds the
        state (asked with the lease's token, which extends the lease by its TTL for the retry)."""
        if holder is None or self.registry.pool(role, lambda w: w.address not in tried).least_loaded() is None:
            return False
        try:
            reply = await holder.stub.ExtendLease(
                common_pb2.LeaseRequest(lease_id=lease.lease_id, token=lease.token),
                metadata=self.registry.call_metadata(),
                timeout=5,
            )
        except grpc.aio.AioRpcError as e:
            log.info("lease not extended for a retry", worker=holder.address, code=e.code().name)
            return False
        return reply.ok

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def release_later(self, w: WorkerHandle, lease: common_pb2.Lease) -> None:
        async def release() -> None:
            try:
                await w.stub.ReleaseLease(
                    common_pb2.LeaseRequest(lease_id=lease.lease_id, token=lease.token),
                    metadata=self.registry.call_metadata(),
                    timeout=5,
                )
            except Exception:
                pass

        self._in_background(release())

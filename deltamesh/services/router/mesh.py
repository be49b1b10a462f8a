"""Runs one request through the mesh: prefill on one worker, decode on another, with the hybrid state
moving between them over the workers' transport under a lease. Shared by the gRPC front door and the REST gateway.

Failure rules: a prefill worker found unavailable is replaced (up to `prefill_retries` times); a decode
worker found unavailable before it streamed anything is replaced too; any other failure of either leg ends
the request at once with an error, cancels the other leg and releases the lease so the prefill worker's
memory is freed. A client that goes away cancels both legs; `abort` does the same on request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog

from deltamesh.engine import SamplingParams
from deltamesh.services.common.convert import sampling_to_proto
from deltamesh.services.router import metrics
from deltamesh.services.router.pd_decider import PdDecider
from deltamesh.services.router.policies import Policy
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2

log = structlog.get_logger("deltamesh.mesh")


class MeshError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _NotHeld(Exception):
    """A decode worker refused a direct request: its prefix cache does not hold the conversation (any more)."""


@dataclass
class _Inflight:
    owner: bytes = b""  # what Abort must present (the nonce of the abort token; empty: only cancelling aborts it)
    call: object = None  # the worker call in progress
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


def _cancelled_call(inflight: _Inflight, leg: str, w: WorkerHandle) -> MeshError:
    """A worker call was cancelled but not our task: an abort, or the call's channel went away. Anything but
    a silent end of the stream. (When our own task is being cancelled, the caller re-raises instead.)"""
    if inflight.aborted:
        return MeshError(grpc.StatusCode.CANCELLED, f"aborted during the {leg} call")
    return _worker_failure(grpc.StatusCode.UNAVAILABLE, leg, w, "call cancelled (connection closed)")


def _own_task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Mesh:
    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        prefill_retries: int = 2,
        timeout_s: float = 600.0,
        ready_timeout_s: float = 10.0,
        pd: PdDecider | None = None,
    ):
        """`ready_timeout_s`: how long a request waits for the mesh to have workers (just started, or all
        restarting) before it fails as UNAVAILABLE. `pd`: which requests skip the prefill worker (None: none)."""
        self.registry, self.policy, self.pd = registry, policy, pd
        self.ready_timeout_s = ready_timeout_s
        self.prefill_retries, self.timeout_s = prefill_retries, timeout_s
        self._inflight: dict[str, _Inflight] = {}
        self._background: set[asyncio.Task] = set()

    @property
    def colocated(self) -> bool:
        return bool(self.registry.healthy("colocated")) and not self.registry.healthy("prefill")

    def missing(self) -> str:
        """What the mesh lacks to serve a request ("" when nothing): a user told only "no healthy workers" while
        the prefill workers are up would look in the wrong place."""
        r = self.registry
        if r.healthy("colocated") or (r.healthy("prefill") and r.healthy("decode")):
            return ""
        lacking = [role for role in ("prefill", "decode") if not r.healthy(role)]
        if len(lacking) == 2:
            return "no healthy workers to serve requests"
        return f"no healthy {lacking[0]} worker (and no colocated one) to serve requests"

    async def _until_ready(self) -> None:
        """Hold a request while no worker can serve it, as a server that is still starting would; bounded."""
        deadline = time.monotonic() + self.ready_timeout_s
        while missing := self.missing():
            if time.monotonic() >= deadline:
                raise MeshError(
                    grpc.StatusCode.UNAVAILABLE, f"{missing} (waited {self.ready_timeout_s:g} s); retry shortly"
                )
            await asyncio.sleep(0.05)

    def _pick(self, role: str, exclude: set[str], prompt_ids=()) -> WorkerHandle:
        candidates = [w for w in self.registry.healthy(role) if w.address not in exclude]
        if not candidates:
            raise MeshError(grpc.StatusCode.UNAVAILABLE, f"no healthy {role} worker is available")
        # decode workers cache nothing of a transferred prompt: only prefill and colocated picks see the prompt
        return self.policy.pick(candidates, prompt_ids if role != "decode" else ())

    def abort(self, request_id: str, owner: bytes) -> bool:
        """Abort the running request `request_id` if `owner` is what it was started with (see generate)."""
        inflight = self._inflight.get(request_id)
        if inflight is None or not inflight.owner or not hmac.compare_digest(inflight.owner, owner):
            return False
        inflight.abort()
        return True

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, owner: bytes = b""
    ) -> AsyncIterator[common_pb2.TokenDelta]:
        """The request's token deltas, first token first; raises MeshError when it cannot be served. `owner`: a
        secret of this run of the request that `abort` must be given (empty: it is aborted by closing the stream)."""
        timer = metrics.RequestTimer()
        outcome = "aborted"  # unless it finishes or fails: the client went away
        try:
            # closed explicitly: a client gone mid-stream releases what its request holds at once, not at GC
            async with contextlib.aclosing(self._generate(request_id, prompt_ids, params, owner)) as deltas:
                async for delta in deltas:
                    timer.delta(len(delta.token_ids), delta.usage.prompt_tokens)
                    if delta.finished:
                        outcome = "aborted" if delta.finish_reason == common_pb2.FINISH_REASON_ABORT else "completed"
                    yield delta
        except MeshError:
            outcome = "error"
            raise
        finally:
            timer.end(outcome)
            ttft = None if timer.first is None else round(timer.first - timer.start, 4)
            log.info(
                "request",
                request_id=request_id,
                outcome=outcome,
                prompt_tokens=len(prompt_ids),
                completion_tokens=timer.tokens,
                ttft_s=ttft,
                seconds=round(time.monotonic() - timer.start, 4),
            )

    async def _generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, owner: bytes):
        if request_id in self._inflight:
            raise MeshError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
        inflight = self._inflight[request_id] = _Inflight(owner)
        sampling, stop = sampling_to_proto(params)
        try:
            await self._until_ready()
            if self.colocated:
                req = decode_pb2.DecodeRequest(
                    request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, stop=stop
                )
                async for delta in self._decode(req, "colocated", inflight):
                    yield delta
                return
            direct = self.pd.direct(self.registry.healthy("decode"), prompt_ids) if self.pd else None
            if direct is not None:  # the decode worker holds the conversation: it prefills the new message itself
                req = decode_pb2.DecodeRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_ids,
                    sampling=sampling,
                    stop=stop,
                    max_uncached_tokens=self.pd.max_suffix,
                )
                try:
                    async for delta in self._remembered(
                        self._decode(req, "decode", inflight, direct), prompt_ids, inflight
                    ):
                        yield delta
                    return
                except _NotHeld:  # its cache no longer holds the conversation: through a prefill worker after all
                    self.pd.refused()
            # the lease's token is ours from the start: a request that goes away while its prefill answer is on the
            # wire can still end the lease it will never see
            prefill_req = prefill_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                stop=stop,
                lease_token=secrets.token_bytes(16),
            )
            offer = await self._offer_prefix(prompt_ids) if self.pd is not None else None
            if offer is not None:
                prefill_req.prefix.CopyFrom(offer[1])
            try:
                first, pw = await self._prefill(prefill_req, inflight)
            finally:  # a no-op once the prefill worker pulled it; else the decode worker's pages are free at once
                if offer is not None:
                    self._release_later(offer[0], offer[1].lease)
            try:
                yield first.first
                if first.first.finished:
                    return
                source = decode_pb2.TransferSource(  # the transport descriptor goes on unread
                    lease=first.lease,
                    transport=first.transport,
                    layout=first.layout,
                    first_token_id=first.first.token_ids[0],
                )
                req = decode_pb2.DecodeRequest(
                    request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, stop=stop, source=source
                )
                deltas = self._decode(req, "decode", inflight)
                if self.pd is not None:
                    deltas = self._remembered(deltas, prompt_ids, inflight, first.first)
                async for delta in deltas:
                    yield delta
            finally:  # never let the lease outlive the request (a no-op once decode pulled the state)
                if first.HasField("lease"):
                    self._release_later(pw, first.lease)
        except MeshError as e:
            if not inflight.aborted:
                raise
            log.info("aborted", request_id=request_id, during=e.message)
            yield common_pb2.TokenDelta(finished=True, finish_reason=common_pb2.FINISH_REASON_ABORT)
        finally:
            del self._inflight[request_id]

    async def _offer_prefix(self, prompt_ids: list[int]) -> tuple[WorkerHandle, prefill_pb2.PrefixSource] | None:
        """The reverse pull: the decode worker that holds the longest prefix of this prompt (a conversation it
        finished), asked to offer it to the prefill worker under a lease whose token is ours. None when no decode
        worker holds one, or it has nothing (evicted) or fails to answer: the prefill worker computes it all."""
        holder, _ = self.pd.holder(self.registry.healthy("decode"), prompt_ids)
        if holder is None:
            return None
        token = secrets.token_bytes(16)
        ask = decode_pb2.OfferPrefixRequest(
            prompt_token_ids=prompt_ids, lease_token=token, min_tokens=self.pd.held.block
        )
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

    async def _prefill(self, req: prefill_pb2.PrefillRequest, inflight: _Inflight):
        tried: set[str] = set()
        while True:
            w = self._pick("prefill", tried, req.prompt_token_ids)
            w.inflight += 1
            inflight.call = w.stub.Prefill(
                req, metadata=self.registry.call_metadata(req.request_id), timeout=self.timeout_s
            )
            try:
                return await inflight.call, w
            except asyncio.CancelledError:
                # an answer on its way is lost with the call (client gone, or an abort): end the lease it may
                # carry, whose token we chose
                self._release_later(w, prefill_pb2.Lease(lease_id=req.request_id, token=req.lease_token))
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

    async def _remembered(self, deltas, prompt_ids: list[int], inflight: _Inflight, first=None):
        """`deltas`, and once they end normally, the whole sequence handed to the P/D decider as held by the
        decode worker that streamed them. `first`: the prefill worker's first token, already streamed."""
        tokens = list(first.token_ids) if first is not None else []
        async for delta in deltas:
            tokens += delta.token_ids
            if delta.finished and delta.finish_reason in (
                common_pb2.FINISH_REASON_STOP,
                common_pb2.FINISH_REASON_LENGTH,
            ):
                self.pd.finished(inflight.worker.address, prompt_ids + tokens)
            yield delta

    async def _decode(
        self, req: decode_pb2.DecodeRequest, role: str, inflight: _Inflight, first_choice: WorkerHandle | None = None
    ):
        tried: set[str] = set()
        while True:
            w = (
                first_choice
                if first_choice is not None and not tried
                else self._pick(role, tried, req.prompt_token_ids)
            )
            inflight.worker = w
            w.inflight += 1
            call = inflight.call = w.stub.Decode(
                req, metadata=self.registry.call_metadata(req.request_id), timeout=self.timeout_s
            )
            streamed = finished = False
            try:
                async for delta in call:
                    streamed = True
                    finished = delta.finished
                    yield delta
                if not finished:
                    raise _worker_failure(grpc.StatusCode.UNAVAILABLE, role, w, "stream ended early")
                return
            except asyncio.CancelledError:
                if _own_task_cancelled():
                    raise
                raise _cancelled_call(inflight, role, w) from None
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and not inflight.aborted:
                    self.registry.mark_failed(w, "decode call unavailable")
                    if self.pd is not None:
                        self.pd.forget(w.address)
                    tried.add(w.address)
                    if not streamed and len(tried) <= 1:
                        metrics.RETRIES.labels(role).inc()
                        log.warning("retrying decode on another worker", failed=w.address)
                        continue
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and req.max_uncached_tokens and not streamed:
                    raise _NotHeld() from None
                if tried and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # the failed worker may have pulled (used up) the lease before dying: a worker fault
                    raise _worker_failure(
                        grpc.StatusCode.UNAVAILABLE,
                        role,
                        w,
                        e.details(),
                        "a decode worker failed and the retry could not take over the request's state; retry it",
                    ) from None
                raise _leg_error(e, role, w) from None
            finally:
                w.inflight -= 1
                inflight.call = None
                if not finished:
                    call.cancel()  # the client left or the stream broke: stop the worker's request

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _release_later(self, w: WorkerHandle, lease: prefill_pb2.Lease) -> None:
        async def release() -> None:
            try:
                await w.stub.ReleaseLease(
                    prefill_pb2.LeaseRequest(lease_id=lease.lease_id, token=lease.token),
                    metadata=self.registry.call_metadata(),
                    timeout=5,
                )
            except Exception:
                pass

        self._in_background(release())

"""Prefill worker: runs prompts (chunked, batched with others), samples the first token, and holds each
request's state under a lease until a decode worker pulls it over the workers' transport."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from deltamesh.engine import FinishReason
from deltamesh.services.common import metrics
from deltamesh.services.common.convert import delta_from_output
from deltamesh.services.common.worker import Worker, engine_request
from deltamesh.services.prefill.reverse_pull import ReversePuller
from deltamesh.transfer import MIN_TOKEN_BYTES, LeaseRefused, LeaseTable, StateHolder
from deltamesh.transfer.leases import extent
from deltamesh.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = structlog.get_logger("deltamesh.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: Worker, leases: LeaseTable, holder: StateHolder, reverse: ReversePuller):
        """`reverse`: pulls the prefixes decode workers offer (PrefillRequest.prefix)."""
        self.worker, self.engine, self.leases, self.holder = worker, worker.engine, leases, holder
        self.reverse = reverse
        self._prefilling: dict[str, asyncio.Task] = {}  # request id -> its Prefill call's task (for Abort)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        await self._check_ttl(request.lease_ttl_ms, context)
        if request.lease_token and len(request.lease_token) < MIN_TOKEN_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lease_token: at least {MIN_TOKEN_BYTES} bytes")
        req = await engine_request(self.engine, request, context, hold_state=True)
        rid = req.request_id
        task = self._prefilling.setdefault(rid, asyncio.current_task())  # a duplicate id is the engine's to refuse
        first = None
        leased = False
        started = time.monotonic()
        try:
            submit = await self._pulled_prefix(request, req.prompt_ids)
            async for out in self.engine.stream(req, submit):
                first = out
            metrics.TTFT.observe(time.monotonic() - started)
            if first.finish_reason == FinishReason.ERROR:
                await context.abort(grpc.StatusCode.INTERNAL, first.error or "prefill failed")
            if first.finish_reason == FinishReason.ABORT:
                await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
            response = prefill_pb2.PrefillResponse(first=delta_from_output(first))
            if first.finish_reason is None:  # more to decode: hold the state under a lease
                self._hold(response, rid, len(req.prompt_ids), request.lease_ttl_ms, request.lease_token or None)
                response.draft_token_ids.extend(self.engine.held_drafts(rid))
                leased = True
                # a caller that went away before the response reached it never learns the token: end the lease now
                context.add_done_callback(lambda ctx: ctx.cancelled() and self.leases.release(rid))
            return response
        finally:
            if task is asyncio.current_task():
                del self._prefilling[rid]
            if not leased and first is not None and first.finish_reason is None:
                self.engine.release_held(rid)  # cancelled between holding and leasing

    async def _pulled_prefix(self, request: prefill_pb2.PrefillRequest, prompt_ids: list[int]):
        """How to submit the request: from the prefix a decode worker offered, once pulled here; None (the
        usual submit, computing what this worker's own cache lacks) without an offer or when the pull fails."""
        if not request.HasField("prefix"):
            return None
        pulled = await self.reverse.pull(request.prefix, prompt_ids)
        if pulled is None:
            return None
        num_tokens, reservation = pulled
        return lambda r, sink: self.engine.submit_pulled(r, num_tokens, reservation, sink)

    def _hold(
        self, response: prefill_pb2.PrefillResponse, rid: str, num_tokens: int, ttl_ms: int, token: bytes | None
    ) -> None:
        """Offer the held state under a lease; the lease, how a puller reaches the state, and its shape go into
        `response`."""
        ttl = ttl_ms / 1000 if ttl_ms else self.worker.settings.lease_ttl_s
        buffers = self.engine.held_buffers(rid)
        lease = self.leases.offer(rid, buffers, ttl, lambda reason: self._ended(rid, reason), token)
        log.info("state held", lease_id=rid, tokens=num_tokens, bytes=lease.nbytes, buffers=len(buffers), ttl_s=ttl)
        response.lease.CopyFrom(
            prefill_pb2.Lease(lease_id=rid, token=lease.token, expires_unix_ms=lease.expires_unix_ms())
        )
        response.transport.CopyFrom(self.holder.offer(lease))
        response.layout.CopyFrom(
            prefill_pb2.StateLayout(
                compat_hash=self.worker.compat_hash,
                num_tokens=num_tokens,
                region_bytes=[extent(b)[1] for b in buffers],
                tensor_parallel_size=self.engine.tensor_parallel_size,
                rank_parts=self.engine.holds_rank_parts,
            )
        )

    def transport_descriptor(self) -> common_pb2.TransportDescriptor:
        """How decode workers reach this worker's pools (made readable now, once), for them to set up their
        transport to it before the first request."""
        return self.holder.describe(self.engine.pool_buffers())

    def _ended(self, rid: str, reason: str) -> None:
        self.engine.release_held(rid)
        if reason != "pulled":
            log.info("lease ended", lease_id=rid, reason=reason)

    async def ReleaseLease(self, request: prefill_pb2.LeaseRequest, context) -> prefill_pb2.LeaseResponse:
        return prefill_pb2.LeaseResponse(ok=self.leases.release(request.lease_id, request.token))

    async def _check_ttl(self, ttl_ms: int, context) -> None:
        """A TTL is bounded: a lease holds a state slot and KV pages that other requests wait for."""
        limit = self.worker.settings.max_lease_ttl_s
        if ttl_ms > limit * 1000:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease TTL {ttl_ms} ms is over this worker's maximum ({limit:g} s, --max-lease-ttl)",
            )

    async def ExtendLease(self, request: prefill_pb2.LeaseRequest, context) -> prefill_pb2.LeaseResponse:
        await self._check_ttl(request.ttl_ms, context)
        ttl = request.ttl_ms / 1000 if request.ttl_ms else self.worker.settings.lease_ttl_s
        try:
            lease = self.leases.extend(request.lease_id, request.token, ttl)
        except LeaseRefused as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return prefill_pb2.LeaseResponse(ok=True, expires_unix_ms=lease.expires_unix_ms())

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        """Stops a prefill in flight, as cancelling its call does. A held lease is not ended here: that takes its
        token (ReleaseLease); nor is the engine asked directly, which would free a held state under a live lease."""
        task = self._prefilling.get(request.request_id)
        if task is not None:
            task.cancel()
        return common_pb2.AbortResponse(found=task is not None)

    async def GetLoads(self, request, context) -> common_pb2.GetLoadsResponse:
        return common_pb2.GetLoadsResponse(workers=[self.worker.load(leases=len(self.leases))])


async def expire_leases(leases: LeaseTable, stop: asyncio.Event, every_s: float = 0.05) -> None:
    while not stop.is_set():
        leases.expire()
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass

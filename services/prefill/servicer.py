"""Prefill worker: runs prompts (chunked, batched with others), samples the first token, and holds each
request's state under a lease until a decode worker pulls it over the UCX side channel."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from deltamesh.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, router_pb2
from engine import FinishReason
from services.common import metrics
from services.common.convert import delta_from_output
from services.common.worker import Worker, engine_request
from transfer import LeaseRefused, LeaseTable, StateServer

log = structlog.get_logger("deltamesh.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: Worker, leases: LeaseTable, state_server: StateServer):
        self.worker, self.engine, self.leases, self.state_server = worker, worker.engine, leases, state_server

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        req = await engine_request(self.engine, request, context, hold_state=True)
        rid = req.request_id
        first = None
        leased = False
        started = time.monotonic()
        try:
            async for out in self.engine.stream(req):
                first = out
            metrics.TTFT.observe(time.monotonic() - started)
            if first.finish_reason == FinishReason.ERROR:
                await context.abort(grpc.StatusCode.INTERNAL, first.error or "prefill failed")
            if first.finish_reason == FinishReason.ABORT:
                await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
            response = prefill_pb2.PrefillResponse(first=delta_from_output(first))
            if first.finish_reason is None:  # more to decode: hold the state under a lease
                response.lease.CopyFrom(self._lease(rid, len(req.prompt_ids), request.lease_ttl_ms))
                response.ucx_address = self.state_server.address
                response.layout.CopyFrom(self._layout(rid, len(req.prompt_ids)))
                leased = True
            return response
        finally:
            if not leased and first is not None and first.finish_reason is None:
                self.engine.core.release_held(rid)  # cancelled between holding and leasing

    def _lease(self, rid: str, num_tokens: int, ttl_ms: int) -> prefill_pb2.Lease:
        ttl = ttl_ms / 1000 if ttl_ms else self.worker.settings.lease_ttl_s
        buffers = [r.tensor for r in self.engine.core.held_regions(rid)]
        lease = self.leases.offer(rid, buffers, ttl, lambda reason: self._ended(rid, reason))
        log.info("state held", lease_id=rid, tokens=num_tokens, bytes=lease.nbytes, buffers=len(buffers), ttl_s=ttl)
        check = self.state_server.lease_check(lease)
        return prefill_pb2.Lease(lease_id=rid, token=lease.token, expires_unix_ms=lease.expires_unix_ms(),
                                 word_address=check.address, word_rkey=check.rkey, nonce=check.nonce)  # fmt: skip

    def _layout(self, rid: str, num_tokens: int) -> prefill_pb2.StateLayout:
        regions = self.state_server.regions([r.tensor for r in self.engine.core.held_regions(rid)])
        return prefill_pb2.StateLayout(compat_hash=self.worker.compat_hash, num_tokens=num_tokens,
                                       region_bytes=[r.nbytes for r in regions], **_where(regions))  # fmt: skip

    def side_channel(self) -> router_pb2.SideChannel:
        """Where this worker's pools and lease words can be read (registered with UCX now, once), for decode
        workers to set up their side channel to it before the first request."""
        regions = self.state_server.regions(self.engine.core.pool_views())
        words = self.state_server.words()
        return router_pb2.SideChannel(ucx_address=self.state_server.address, **_where(regions),
                                      lease_words_address=words.address, lease_words_rkey=words.rkey)  # fmt: skip

    def _ended(self, rid: str, reason: str) -> None:
        self.engine.core.release_held(rid)
        if reason != "pulled":
            log.info("lease ended", lease_id=rid, reason=reason)

    async def ReleaseLease(self, request: prefill_pb2.LeaseRequest, context) -> prefill_pb2.LeaseResponse:
        return prefill_pb2.LeaseResponse(ok=self.leases.release(request.lease_id, request.token))

    async def ExtendLease(self, request: prefill_pb2.LeaseRequest, context) -> prefill_pb2.LeaseResponse:
        ttl = request.ttl_ms / 1000 if request.ttl_ms else self.worker.settings.lease_ttl_s
        try:
            lease = self.leases.extend(request.lease_id, request.token, ttl)
        except LeaseRefused as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return prefill_pb2.LeaseResponse(ok=True, expires_unix_ms=lease.expires_unix_ms())

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        found = self.leases.release(request.request_id) or request.request_id in self.engine.core.requests
        self.engine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def GetLoads(self, request, context) -> common_pb2.GetLoadsResponse:
        return common_pb2.GetLoadsResponse(workers=[self.worker.load(leases=len(self.leases))])


def _where(regions) -> dict:
    """The proto fields (StateLayout's, SideChannel's) saying where regions start and their remote keys."""
    return {"region_addresses": [r.address for r in regions], "region_rkeys": [r.rkey for r in regions]}


async def expire_leases(leases: LeaseTable, stop: asyncio.Event, every_s: float = 0.05) -> None:
    while not stop.is_set():
        leases.expire()
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass

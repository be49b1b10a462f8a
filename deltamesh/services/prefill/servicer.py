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
from deltamesh.services.common.state_exchange import HolderSide, PullerSide
from deltamesh.services.common.worker import Worker, engine_request
from deltamesh.services.prefill.reverse_pull import ReversePuller
from deltamesh.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = structlog.get_logger("deltamesh.prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: Worker, holding: HolderSide, pulling: PullerSide):
        """`holding`: the states this worker computed, for decode workers; `pulling`: how it pulls the prefixes
        decode workers offer (PrefillRequest.prefix)."""
        self.worker, self.engine, self.holding, self.pulling = worker, worker.engine, holding, pulling
        self.reverse = ReversePuller(worker, pulling)
        self._prefilling: dict[str, asyncio.Task] = {}  # request id -> its Prefill call's task (for Abort)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        await self.holding.check(context, request.lease_ttl_ms, request.lease_token, token_required=False)
        req = await engine_request(self.engine, request, context, hold_state=True)
        rid = req.request_id
        current = asyncio.current_task()
        assert current is not None, "a gRPC call runs in a task"
        task = self._prefilling.setdefault(rid, current)  # a duplicate id is the engine's to refuse
        first = None
        leased = False
        started = time.monotonic()
        try:
            submit = await self._pulled_prefix(request, req.prompt_ids)
            async for out in self.engine.stream(req, submit):
                first = out
            metrics.TTFT.observe(time.monotonic() - started)
            assert first is not None, "an engine stream ends with an output"
            if first.finish_reason == FinishReason.ERROR:
                await context.abort(grpc.StatusCode.INTERNAL, first.error or "prefill failed")
            if first.finish_reason == FinishReason.ABORT:
                await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
            response = prefill_pb2.PrefillResponse(first=delta_from_output(first))
            if first.finish_reason is None:  # more to decode: hold the state under a lease
                offered = await self.holding.offer(
                    context,
                    rid,
                    self.engine.held_buffers(rid),
                    len(req.prompt_ids),
                    request.lease_ttl_ms,
                    request.lease_token or None,
                    lambda reason: self.engine.release_held(rid),
                )
                response.draft_token_ids.extend(self.engine.held_drafts(rid))  # speculative decoding's first drafts
                leased = True
                response.lease.CopyFrom(offered.lease)
                response.layout.CopyFrom(offered.layout)
                response.transport.CopyFrom(offered.transport)
            return response
        finally:
            if task is asyncio.current_task():
                del self._prefilling[rid]
            if not leased and first is not None and first.finish_reason is None:
                self.engine.release_held(rid)  # cancelled between holding and leasing

    async def _pulled_prefix(self, request: prefill_pb2.PrefillRequest, prompt_ids: list[int]):
        """How to submit the request: from the prefix a decode worker offered, once pulled here; None (the
        usual submit, computing what this worker's own cache lacks) without an offer or when the pull fails."""
        if not request.HasField("prefix") or request.sampling.HasField("prompt_logprobs"):
            return None  # (a prompt's logprobs need every position computed here)
        pulled = await self.reverse.pull(request.prefix, prompt_ids)
        if pulled is None:
            return None
        num_tokens, reservation = pulled
        return lambda r, sink: self.engine.submit_pulled(r, num_tokens, reservation, sink)

    async def ReleaseLease(self, request: common_pb2.LeaseRequest, context) -> common_pb2.LeaseResponse:
        return self.holding.release(request)

    async def ExtendLease(self, request: common_pb2.LeaseRequest, context) -> common_pb2.LeaseResponse:
        return await self.holding.extend(request, context)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        """Stops a prefill in flight, as cancelling its call does. A held lease is not ended here: that takes its
        token (ReleaseLease); nor is the engine asked directly, which would free a held state under a live lease."""
        task = self._prefilling.get(request.request_id)
        if task is not None:
            task.cancel()
        return common_pb2.AbortResponse(found=task is not None)

    async def GetLoads(self, request: common_pb2.GetLoadsRequest, context) -> common_pb2.GetLoadsResponse:
        self.pulling.announce(request.holders)  # decode workers whose prefix offers this worker may pull
        return common_pb2.GetLoadsResponse(
            workers=[self.worker.load(leases=len(self.holding.leases))], holder=self.holding.description
        )

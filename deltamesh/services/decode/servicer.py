"""Decode worker: admits requests from any prefill worker, pulls their state over the workers' transport into its
own pools, and continues them in its continuous batch, streaming tokens. Without a transfer source (colocated
mode) it prefills the prompt itself."""

from __future__ import annotations

import time

import grpc
import structlog

from deltamesh.services.common import metrics
from deltamesh.services.common.convert import delta_from_output
from deltamesh.services.common.state_exchange import HolderSide, PullerSide, PullFailed
from deltamesh.services.common.worker import Worker, engine_request
from deltamesh.services.decode.feed import Feeds
from deltamesh.services.decode.offers import PrefixOffers
from deltamesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = structlog.get_logger("deltamesh.decode")


# How Decode ends when the state did not arrive (PullerSide.pull): a failed pull is the transfer's failure, not this
# worker's (ABORTED: the router may have another decode worker pull while the lease lives)
_PULL_FAILED = {
    "layout": grpc.StatusCode.FAILED_PRECONDITION,
    "descriptor": grpc.StatusCode.INVALID_ARGUMENT,
    "no room": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "transfer": grpc.StatusCode.ABORTED,
}


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: Worker, pulling: PullerSide, holding: HolderSide | None = None):
        """`holding`: the prefixes this worker offers to prefill workers (None: it offers none: a colocated worker,
        or one without a prefix cache)."""
        self.worker, self.engine, self.pulling, self.holding = worker, worker.engine, pulling, holding
        self.offers = PrefixOffers(worker, holding) if holding is not None else None
        self.feeds = Feeds()

    async def Feed(self, request: decode_pb2.FeedRequest, context):
        async for batch in self.feeds.serve(request.feed_id, context):
            yield batch

    async def OfferPrefix(self, request: decode_pb2.OfferPrefixRequest, context) -> decode_pb2.OfferPrefixResponse:
        if self.offers is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker offers no prefixes (no prefix cache)")
        assert self.offers is not None  # (context.abort raised)
        return await self.offers.offer(request, context)

    async def ReleaseLease(self, request: common_pb2.LeaseRequest, context) -> common_pb2.LeaseResponse:
        if self.holding is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker holds no leases (no prefix cache)")
        assert self.holding is not None  # (context.abort raised)
        return self.holding.release(request)

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        feed = None
        if request.feed_id:  # looked up before any work (a pull): the router retries without it
            feed = self.feeds.open.get(request.feed_id)
            if feed is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "the token feed is not open")
        req = await engine_request(self.engine, request, context)
        submit = None
        times = metrics.TokenTimes(colocated=not request.HasField("source"))  # colocated: it makes the first token
        if request.HasField("source"):
            reservation = await self._receive_state(request, context)
            first, drafts = request.source.first_token_id, list(request.source.draft_token_ids)
            submit = lambda r, sink: self.engine.submit_transferred(r, first, reservation, sink, drafts)  # noqa: E731
        elif request.max_uncached_tokens:
            uncached = len(req.prompt_ids) - self.engine.cached_tokens(req.prompt_ids)
            if uncached > request.max_uncached_tokens:  # not held here (evicted): a prefill worker's job
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{uncached} prompt tokens are not in this "
                    f"worker's prefix cache (at most {request.max_uncached_tokens} asked)",
                )
        if feed is not None:  # its deltas go on the feed; this call ends once the last is written there
            await self.feeds.decode(feed, request.feed_key, req, submit, times, self.engine, context)
            return
        async for out in self.engine.stream(req, submit):  # one token, or several when this stream fell behind
            times.observe(len(out.new_token_ids), out.num_output_tokens, time.monotonic())
            yield delta_from_output(out)

    async def _receive_state(self, request: decode_pb2.DecodeRequest, context):
        src = request.source
        if src.layout.num_tokens != len(request.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "state token count does not match the prompt")
        try:
            pulled = await self.pulling.pull(
                src.lease, src.layout, src.transport, room_wait_s=self.worker.settings.admission_timeout_s
            )
        except PullFailed as e:
            if e.stage == "transfer":
                metrics.TRANSFERS.labels("refused" if e.refused else "failed").inc()
                log.warning("state transfer failed", lease_id=src.lease.lease_id, refused=e.refused, error=e.message)
            message = f"decode worker is full: {e.message} (--admission-timeout)" if e.stage == "no room" else e.message
            await context.abort(_PULL_FAILED[e.stage], message)
        stats = pulled.stats
        metrics.TRANSFERS.labels("ok").inc()
        metrics.TRANSFER_BYTES.observe(stats.nbytes)
        metrics.TRANSFER_SECONDS.observe(stats.seconds)
        metrics.TRANSFER_BUFFERS.observe(stats.buffers)
        log.info(
            "state received",
            bytes=stats.nbytes,
            buffers=stats.buffers,
            seconds=round(stats.seconds, 6),
            gbps=round(stats.gbps, 3),
        )
        return pulled.reservation

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        found = self.engine.has_request(request.request_id)
        self.engine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def GetLoads(self, request: common_pb2.GetLoadsRequest, context) -> common_pb2.GetLoadsResponse:
        self.pulling.announce(request.holders)  # prefill workers whose states this worker may pull
        reply = common_pb2.GetLoadsResponse()
        leases = 0
        if self.holding is not None:
            leases = len(self.holding.leases)  # prefixes offered, not yet pulled
            if self.holding.description is not None:
                reply.holder.CopyFrom(self.holding.description)
        reply.workers.append(self.worker.load(leases=leases))
        return reply

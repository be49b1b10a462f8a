"""Decode worker: admits requests from any prefill worker, pulls their state over the workers' transport into its
own pools, and continues them in its continuous batch, streaming tokens. Without a transfer source (colocated
mode) it prefills the prompt itself."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from deltamesh.engine import PoolExhausted
from deltamesh.engine.handoff import LayoutMismatch
from deltamesh.services.common import metrics
from deltamesh.services.common.convert import delta_from_output
from deltamesh.services.common.worker import Worker, engine_request
from deltamesh.services.decode.offers import PrefixOffers
from deltamesh.transfer import DescriptorError, LeaseKey, StatePuller, TransferError
from deltamesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = structlog.get_logger("deltamesh.decode")


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: Worker, puller: StatePuller, offers: PrefixOffers | None = None):
        """`offers`: how this worker offers cached prefixes to prefill workers (None: a colocated worker)."""
        self.worker, self.engine, self.puller, self.offers = worker, worker.engine, puller, offers

    async def OfferPrefix(self, request: decode_pb2.OfferPrefixRequest, context) -> decode_pb2.OfferPrefixResponse:
        if self.offers is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a colocated worker offers no prefixes")
        return await self.offers.offer(request, context)

    async def ReleaseLease(self, request, context):
        if self.offers is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a colocated worker holds no leases")
        return await self.offers.release(request, context)

    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        req = await engine_request(self.engine, request, context)
        submit = None
        started = last = time.monotonic()
        colocated = not request.HasField("source")  # this worker makes the first token too
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
        async for out in self.engine.stream(req, submit):
            if out.new_token_ids:  # one token, or several when this stream fell behind (Engine.stream)
                now = time.monotonic()
                if colocated and out.num_output_tokens == len(out.new_token_ids):
                    metrics.TTFT.observe(now - started)
                else:
                    metrics.TPOT.observe((now - last) / len(out.new_token_ids))
                last = now
            yield delta_from_output(out)

    async def _receive_state(self, request: decode_pb2.DecodeRequest, context):
        src, layout = request.source, request.source.layout
        if layout.compat_hash != self.worker.compat_hash:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"incompatible state layout: prefill {layout.compat_hash}, decode {self.worker.compat_hash}",
            )
        try:  # the regions are in the one-rank layout or the sender's rank parts; its ranks must split this model
            self.engine.check_sender_layout(layout.tensor_parallel_size or 1)
        except LayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible state layout: {e}")
        if layout.num_tokens != len(request.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "state token count does not match the prompt")
        if not src.lease.token:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease: its token is needed")
        lease = LeaseKey(src.lease.lease_id, src.lease.token)
        try:  # nothing moves yet: a descriptor this worker cannot use is refused before any pool space is taken
            source = self.puller.source(src.transport, lease, layout.region_bytes)
        except DescriptorError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        parts = (layout.tensor_parallel_size or 1) if layout.rank_parts else 0
        reservation = await self._reserve(len(request.prompt_token_ids), context, parts)
        self.worker.reservations += 1
        try:
            buffers = [r.tensor for r in reservation.regions]
            stats = await self.puller.pull(source, buffers, self.worker.settings.transfer_timeout_s)
        except TransferError as e:
            metrics.TRANSFERS.labels("refused" if e.refused else "failed").inc()
            self._release(src.lease.lease_id, reservation)
            code = grpc.StatusCode.FAILED_PRECONDITION if e.refused else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"state transfer failed: {e}")
        except BaseException:
            self._release(src.lease.lease_id, reservation)
            raise
        finally:
            self.worker.reservations -= 1
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
        return reservation

    def _release(self, lease_id: str, reservation) -> None:
        """A failed pull's pages and slot go back to the pool once the transport can no longer write into them."""
        self.puller.release_after(lease_id, lambda: self.engine.cancel_reservation(reservation))

    async def _reserve(self, num_tokens: int, context, sender_parts: int = 0):
        """Pool space for the incoming state (`sender_parts`: see Engine.reserve), once nothing but the pull can
        write it; waits (bounded) while the batch is full."""
        deadline = time.monotonic() + self.worker.settings.admission_timeout_s
        delay = 0.002
        while True:
            try:
                reservation = self.engine.reserve(num_tokens, sender_parts)
                break
            except PoolExhausted as e:
                if time.monotonic() + delay > deadline:
                    waited = self.worker.settings.admission_timeout_s
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"decode worker is full: no pool space within {waited:g} s (--admission-timeout): {e}",
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
        if (
            reservation.ready is not None
        ):  # a step launched before may still write this space (deltamesh/engine/core.py)
            await asyncio.to_thread(reservation.wait_ready)
        return reservation

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        found = self.engine.has_request(request.request_id)
        self.engine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def GetLoads(self, request, context) -> common_pb2.GetLoadsResponse:
        leases = len(self.offers.leases) if self.offers is not None else 0  # prefixes offered, not yet pulled
        return common_pb2.GetLoadsResponse(workers=[self.worker.load(leases=leases)])

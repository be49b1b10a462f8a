"""Decode worker, the reverse direction: offers a prompt's longest cached prefix (a conversation this worker
finished) to a prefill worker, which pulls it over the side channel instead of recomputing the previous turns.

The prefix stays in place in the prefix cache: its pages and GDN checkpoint are pinned (eviction leaves them) and
held under a lease in this worker's LeaseTable, with the forward direction's rules (TTL bounded by
--max-lease-ttl, the caller's secret token, the lease word that a puller checks after its reads). The pin ends
with the lease, however it ends: pulled, released, expired or abandoned."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import structlog

from deltamesh.services.common import metrics
from deltamesh.services.common.worker import Worker
from deltamesh.transfer import MIN_TOKEN_BYTES, LeaseRefused, LeaseTable, StateHolder
from deltamesh.v1 import decode_pb2, prefill_pb2

log = structlog.get_logger("deltamesh.decode")


class PrefixOffers:
    def __init__(self, worker: Worker, leases: LeaseTable, holder: StateHolder):
        self.worker, self.engine, self.leases, self.holder = worker, worker.engine, leases, holder
        self._holder_started: asyncio.Task | None = None

    async def _start_holder(self) -> None:
        """The side channel's holder starts with the first offer: only a router with the P/D decider asks for
        offers, and a decode worker that is never asked keeps its side channel to pulling."""
        if self._holder_started is None:
            self._holder_started = asyncio.ensure_future(self.holder.start())
        await asyncio.shield(self._holder_started)

    async def offer(self, request: decode_pb2.OfferPrefixRequest, context) -> decode_pb2.OfferPrefixResponse:
        await self._start_holder()
        limit = self.worker.settings.max_lease_ttl_s
        if request.lease_ttl_ms > limit * 1000:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease TTL {request.lease_ttl_ms} ms is over this worker's maximum ({limit:g} s, --max-lease-ttl)",
            )
        if len(request.lease_token) < MIN_TOKEN_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lease_token: at least {MIN_TOKEN_BYTES} bytes")
        found = self.engine.pin_prefix(list(request.prompt_token_ids))
        if found is None:
            metrics.PREFIX_OFFERS.labels("none").inc()
            return decode_pb2.OfferPrefixResponse()
        pinned, buffers = found
        if pinned.num_tokens < request.min_tokens:
            self.engine.unpin_prefix(pinned)
            metrics.PREFIX_OFFERS.labels("none").inc()
            return decode_pb2.OfferPrefixResponse()
        if self.engine.device.type == "cuda":  # the checkpoint's copy may still be queued on the engine's stream
            await asyncio.to_thread(self.engine.synchronize)
        ttl = request.lease_ttl_ms / 1000 if request.lease_ttl_ms else self.worker.settings.lease_ttl_s
        lease_id = f"prefix-{secrets.token_hex(8)}"
        try:
            lease = self.leases.offer(
                lease_id, buffers, ttl, lambda reason: self._ended(pinned, lease_id, reason), request.lease_token
            )
        except LeaseRefused as e:
            self.engine.unpin_prefix(pinned)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        # a caller that went away before the answer reached it never learns the lease's id: end the lease now
        context.add_done_callback(lambda ctx: ctx.cancelled() and self.leases.release(lease_id))
        metrics.PREFIX_OFFERS.labels("offered").inc()
        log.info("prefix offered", lease_id=lease_id, tokens=pinned.num_tokens, bytes=lease.nbytes, ttl_s=ttl)
        return decode_pb2.OfferPrefixResponse(
            lease=prefill_pb2.Lease(lease_id=lease_id, token=lease.token, expires_unix_ms=lease.expires_unix_ms()),
            layout=prefill_pb2.StateLayout(
                compat_hash=self.worker.compat_hash,
                num_tokens=pinned.num_tokens,
                region_bytes=[b.numel() for b in buffers],
                tensor_parallel_size=self.engine.tensor_parallel_size,
            ),
            transport=self.holder.offer(lease),
        )

    def _ended(self, pinned, lease_id: str, reason: str) -> None:
        self.engine.unpin_prefix(pinned)
        if reason != "pulled":
            log.info("prefix offer ended", lease_id=lease_id, reason=reason)

    async def release(self, request: prefill_pb2.LeaseRequest, context) -> prefill_pb2.LeaseResponse:
        return prefill_pb2.LeaseResponse(ok=self.leases.release(request.lease_id, request.token))

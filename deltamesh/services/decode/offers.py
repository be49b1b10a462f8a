"""Decode worker, the reverse direction: offers a prompt's longest cached prefix (a conversation this worker
finished) to a prefill worker, which pulls it over the side channel instead of recomputing the previous turns.

The prefix stays in place in the prefix cache: its pages and GDN checkpoint are pinned (eviction leaves them) and
held under a lease of this worker's own (HolderSide: the forward direction's rules). The pin ends with the lease,
however it ends: pulled, released, expired or abandoned."""

from __future__ import annotations

import asyncio
import secrets

from deltamesh.services.common import metrics
from deltamesh.services.common.state_exchange import HolderSide
from deltamesh.services.common.worker import Worker
from deltamesh.v1 import decode_pb2


class PrefixOffers:
    def __init__(self, worker: Worker, holding: HolderSide):
        self.worker, self.engine, self.holding = worker, worker.engine, holding

    async def offer(self, request: decode_pb2.OfferPrefixRequest, context) -> decode_pb2.OfferPrefixResponse:
        await self.holding.check(context, request.lease_ttl_ms, request.lease_token, token_required=True)
        found = self.engine.pin_prefix(list(request.prompt_token_ids))
        if found is None:
            metrics.PREFIX_OFFERS.labels("none").inc()
            return decode_pb2.OfferPrefixResponse()
        pinned, buffers = found
        offered = None
        try:
            if pinned.num_tokens < request.min_tokens:
                metrics.PREFIX_OFFERS.labels("none").inc()
                return decode_pb2.OfferPrefixResponse()
            if self.engine.device.type == "cuda":  # the checkpoint's copy may still be queued on the engine's stream
                await asyncio.to_thread(self.engine.synchronize)
            offered = await self.holding.offer(
                context,
                f"prefix-{secrets.token_hex(8)}",
                buffers,
                pinned.num_tokens,
                request.lease_ttl_ms,
                request.lease_token,
                lambda reason: self.engine.unpin_prefix(pinned),
            )
        finally:
            if offered is None:  # nothing offered (too short, cancelled, no lease free): the pin ends here
                self.engine.unpin_prefix(pinned)
        metrics.PREFIX_OFFERS.labels("offered").inc()
        return decode_pb2.OfferPrefixResponse(lease=offered.lease, layout=offered.layout, transport=offered.transport)

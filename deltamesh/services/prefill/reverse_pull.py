"""Prefill worker, the reverse direction: before computing a prompt, pull the prefix a decode worker offered
(PrefillRequest.prefix: the conversation's previous turns, kept in that worker's prefix cache) into this worker's
pools, so that only the rest is computed.

It is an optimisation and never fails a request: an offer that does not fit (another model or layout, a prefix
no longer than what this worker's own cache holds), a lease gone, a pool without room, a pull that fails or runs
past its deadline each leave the prompt to be computed as usual, and are counted."""

from __future__ import annotations

import structlog

from deltamesh.engine.reservations import Reservation
from deltamesh.services.common import metrics
from deltamesh.services.common.state_exchange import PullerSide, PullFailed
from deltamesh.services.common.worker import Worker
from deltamesh.v1 import prefill_pb2

log = structlog.get_logger("deltamesh.prefill")


class ReversePuller:
    def __init__(self, worker: Worker, pulling: PullerSide):
        self.worker, self.engine, self.pulling = worker, worker.engine, pulling

    async def pull(self, prefix: prefill_pb2.PrefixSource, prompt_ids: list[int]) -> tuple[int, Reservation] | None:
        """(tokens covered, the reservation holding their state) for `submit_pulled`, or None: compute it all."""
        reason = self._unusable(prefix, prompt_ids)
        if reason is not None:
            metrics.REVERSE_PULLS.labels("skipped" if reason == "own cache" else "failed").inc()
            log.info("prefix offer not pulled", reason=reason, tokens=prefix.layout.num_tokens)
            return None
        num_tokens = prefix.layout.num_tokens
        try:  # no waiting for room: computing the prompt is the alternative
            pulled = await self.pulling.pull(prefix.lease, prefix.layout, prefix.transport, room_wait_s=0)
        except PullFailed as e:
            metrics.REVERSE_PULLS.labels("failed").inc()
            log.warning("prefix pull failed; computing the prompt instead", reason=e.message, tokens=num_tokens)
            return None
        metrics.REVERSE_PULLS.labels("ok").inc()
        log.info("prefix pulled", tokens=num_tokens, bytes=pulled.stats.nbytes, seconds=round(pulled.stats.seconds, 6))
        return num_tokens, pulled.reservation

    def _unusable(self, prefix: prefill_pb2.PrefixSource, prompt_ids: list[int]) -> str | None:
        """Why this offer is not worth pulling or cannot be pulled here, or None (what any pull checks besides:
        PullerSide.pull)."""
        layout = prefix.layout
        if (layout.tensor_parallel_size or 1) != 1 or self.engine.tensor_parallel_size != 1:
            return "a tensor-parallel worker's pools are split across ranks"
        if not 0 < layout.num_tokens < len(prompt_ids):
            return f"an offer of {layout.num_tokens} tokens for a {len(prompt_ids)}-token prompt"
        if self.engine.cached_tokens(prompt_ids) >= layout.num_tokens:
            return "own cache"
        return None

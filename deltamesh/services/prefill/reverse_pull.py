"""Prefill worker, the reverse direction: before computing a prompt, pull the prefix a decode worker offered
(PrefillRequest.prefix: the conversation's previous turns, kept in that worker's prefix cache) into this worker's
pools, so that only the rest is computed.

It is an optimisation and never fails a request: an offer that does not fit (another model or layout, a prefix
no longer than what this worker's own cache holds), a lease gone, a pool without room, a pull that fails or runs
past its deadline each leave the prompt to be computed as usual, and are counted."""

from __future__ import annotations

import time

import structlog

from deltamesh.engine import PoolExhausted
from deltamesh.engine.reservations import Reservation
from deltamesh.services.common import metrics
from deltamesh.services.common.worker import Worker
from deltamesh.transfer import DescriptorError, LeaseKey, StatePuller, TransferError
from deltamesh.v1 import prefill_pb2

log = structlog.get_logger("deltamesh.prefill")


class ReversePuller:
    def __init__(self, worker: Worker, puller: StatePuller):
        self.worker, self.engine, self.puller = worker, worker.engine, puller

    async def pull(self, prefix: prefill_pb2.PrefixSource, prompt_ids: list[int]) -> tuple[int, Reservation] | None:
        """(tokens covered, the reservation holding their state) for `submit_pulled`, or None: compute it all."""
        reason = self._unusable(prefix, prompt_ids)
        if reason is not None:
            metrics.REVERSE_PULLS.labels("skipped" if reason == "own cache" else "failed").inc()
            log.info("prefix offer not pulled", reason=reason, tokens=prefix.layout.num_tokens)
            return None
        num_tokens = prefix.layout.num_tokens
        try:  # nothing moves yet: a descriptor this worker cannot use is refused before any pool space is taken
            source = self.puller.source(
                prefix.transport, LeaseKey(prefix.lease.lease_id, prefix.lease.token), prefix.layout.region_bytes
            )
            reservation = self.engine.reserve(num_tokens)
        except (DescriptorError, PoolExhausted) as e:
            return self._failed(f"{type(e).__name__}: {e}", num_tokens)
        self.worker.reservations += 1
        try:
            await reservation.wait_ready_async()
            started = time.monotonic()
            stats = await self.puller.pull(
                source, [r.tensor for r in reservation.regions], self.worker.settings.transfer_timeout_s
            )
        except TransferError as e:
            self.puller.release_after(prefix.lease.lease_id, lambda: self.engine.cancel_reservation(reservation))
            return self._failed(str(e), num_tokens)
        except BaseException:
            self.puller.release_after(prefix.lease.lease_id, lambda: self.engine.cancel_reservation(reservation))
            raise
        finally:
            self.worker.reservations -= 1
        metrics.REVERSE_PULLS.labels("ok").inc()
        log.info("prefix pulled", tokens=num_tokens, bytes=stats.nbytes, seconds=round(time.monotonic() - started, 6))
        return num_tokens, reservation

    def _unusable(self, prefix: prefill_pb2.PrefixSource, prompt_ids: list[int]) -> str | None:
        """Why this offer is not worth pulling or cannot be pulled here, or None."""
        layout = prefix.layout
        if layout.compat_hash != self.worker.compat_hash:
            return f"incompatible state layout: decode {layout.compat_hash}, prefill {self.worker.compat_hash}"
        if (layout.tensor_parallel_size or 1) != 1 or self.engine.tensor_parallel_size != 1:
            return "a tensor-parallel worker's pools are split across ranks"
        if not 0 < layout.num_tokens < len(prompt_ids):
            return f"an offer of {layout.num_tokens} tokens for a {len(prompt_ids)}-token prompt"
        if not prefix.lease.token:
            return "the offer's lease has no token"
        if self.engine.cached_tokens(prompt_ids) >= layout.num_tokens:
            return "own cache"
        return None

    def _failed(self, reason: str, num_tokens: int) -> None:
        metrics.REVERSE_PULLS.labels("failed").inc()
        log.warning("prefix pull failed; computing the prompt instead", reason=reason, tokens=num_tokens)
        return None

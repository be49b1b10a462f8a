"""Moving a request's state between workers, as both roles do it: a prefill worker holds the states it computed for
decode workers, and pulls the conversation prefixes decode workers offer (the reverse pull); a decode worker pulls
the states prefill workers hold, and holds the prefixes it offers. The state itself is opaque here: a list of
regions the engine hands out or reserves, and a layout whose compatibility the engine decides.

- Holder side (`HolderSide`): a state goes on offer under a lease of the worker's LeaseTable (its TTL bounded by
  --max-lease-ttl, the caller's token, the lease word a puller checks after its reads); the answer carries the
  lease, the state's layout and the transport's descriptor. The lease ends once, however it ends: pulled or
  abandoned (the puller's notice), released (its token), expired, or the caller gone before the answer reached it.
- Puller side (`PullerSide`): check the layout, turn the descriptor into a source (refused before anything is
  reserved), reserve pool space (waiting for room up to a limit), pull under the transfer deadline, and give the
  space back once nothing can write it if the pull fails. It also keeps what the control plane announced: a
  puller refuses the descriptors of holders it was not told of (docs/notes/side-channel-security.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import structlog

from deltamesh.engine import PoolExhausted
from deltamesh.engine.handoff import LayoutMismatch
from deltamesh.engine.reservations import Reservation
from deltamesh.services.common.worker import Worker
from deltamesh.transfer import (
    MIN_TOKEN_BYTES,
    DescriptorError,
    LeaseKey,
    LeaseRefused,
    LeaseTable,
    StatePuller,
    TransferError,
    TransferStats,
    Transport,
)
from deltamesh.transfer.leases import Held, extent
from deltamesh.v1 import common_pb2

log = structlog.get_logger("deltamesh.exchange")


@dataclass
class Offered:
    """A state on offer, as the caller receives it."""

    lease: common_pb2.Lease
    layout: common_pb2.StateLayout
    transport: common_pb2.TransportDescriptor


class HolderSide:
    def __init__(self, worker: Worker, transport: Transport):
        self.worker, self.engine = worker, worker.engine
        self.leases = LeaseTable(capacity=worker.engine.num_state_slots)  # a lease holds a state slot (or checkpoint)
        self.holder = transport.holder(self.leases)
        if worker.engine.rank_memory:  # a parallel engine's states held on its other ranks stay there
            self.holder.add_ranks(worker.engine.rank_memory)
        self.description: common_pb2.TransportDescriptor | None = None  # for the router to announce (describe)

    async def start(self, pools: list[Held]) -> None:
        """`pools`: the memory pullers warm their reads up with (made readable now, once)."""
        await self.holder.start()
        self.description = self.holder.describe(pools)

    async def stop(self) -> None:
        await self.holder.stop()

    async def check(self, context, ttl_ms: int, token: bytes, token_required: bool) -> None:
        """INVALID_ARGUMENT for a TTL over --max-lease-ttl (a lease holds memory other requests wait for) or a
        token too short to be secret."""
        limit = self.worker.settings.max_lease_ttl_s
        if ttl_ms > limit * 1000:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease TTL {ttl_ms} ms is over this worker's maximum ({limit:g} s, --max-lease-ttl)",
            )
        if (token or token_required) and len(token) < MIN_TOKEN_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lease_token: at least {MIN_TOKEN_BYTES} bytes")

    async def offer(
        self,
        context,
        lease_id: str,
        buffers: list[Held],
        num_tokens: int,
        ttl_ms: int,
        token: bytes | None,
        on_end: Callable[[str], None],
    ) -> Offered:
        """Offer the state in `buffers` (after exactly `num_tokens` tokens) under lease `lease_id`; `on_end(reason)`
        frees it once the lease ends. RESOURCE_EXHAUSTED (and `on_end` not called) when no lease is free."""
        ttl = ttl_ms / 1000 if ttl_ms else self.worker.settings.lease_ttl_s
        try:
            lease = self.leases.offer(
                lease_id, buffers, ttl, lambda reason: self._ended(lease_id, reason, on_end), token
            )
        except LeaseRefused as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        # a caller that went away before the answer reached it never learns the lease: end it now
        context.add_done_callback(lambda ctx: ctx.cancelled() and self.leases.release(lease_id))
        log.info(
            "state offered", lease_id=lease_id, tokens=num_tokens, bytes=lease.nbytes, buffers=len(buffers), ttl_s=ttl
        )
        return Offered(
            lease=common_pb2.Lease(lease_id=lease_id, token=lease.token, expires_unix_ms=lease.expires_unix_ms()),
            layout=common_pb2.StateLayout(
                compat_hash=self.worker.compat_hash,
                num_tokens=num_tokens,
                region_bytes=[extent(b)[1] for b in buffers],
                tensor_parallel_size=self.engine.tensor_parallel_size,
                rank_parts=self.engine.holds_rank_parts,
            ),
            transport=self.holder.offer(lease),
        )

    @staticmethod
    def _ended(lease_id: str, reason: str, on_end: Callable[[str], None]) -> None:
        on_end(reason)
        if reason != "pulled":
            log.info("lease ended", lease_id=lease_id, reason=reason)

    def release(self, request: common_pb2.LeaseRequest) -> common_pb2.LeaseResponse:
        return common_pb2.LeaseResponse(ok=self.leases.release(request.lease_id, request.token))

    async def extend(self, request: common_pb2.LeaseRequest, context) -> common_pb2.LeaseResponse:
        """NOT_FOUND when the lease ended (or the token is wrong): what a caller asks before it lets another
        puller try."""
        await self.check(context, request.ttl_ms, b"", token_required=False)
        ttl = request.ttl_ms / 1000 if request.ttl_ms else self.worker.settings.lease_ttl_s
        try:
            lease = self.leases.extend(request.lease_id, request.token, ttl)
        except LeaseRefused as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return common_pb2.LeaseResponse(ok=True, expires_unix_ms=lease.expires_unix_ms())

    async def expire_forever(self, stop: asyncio.Event, every_s: float = 0.05) -> None:
        while not stop.is_set():
            self.leases.expire()
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass


class PullFailed(Exception):
    """A pull that did not happen, or failed; nothing of it is left reserved. `stage`: "layout" (the state cannot
    go into this worker's pools), "descriptor" (refused before anything was reserved), "no room" (no pool space in
    time), "transfer" (the pull itself failed or was refused by the lease's check; `refused` says which)."""

    def __init__(self, stage: str, message: str, refused: bool = False):
        super().__init__(message)
        self.stage, self.message, self.refused = stage, message, refused


@dataclass
class Pulled:
    reservation: Reservation  # the state, in this worker's pools: for the engine's submit_transferred / submit_pulled
    stats: TransferStats


class PullerSide:
    def __init__(
        self,
        worker: Worker,
        puller: StatePuller,
        on_announced: Callable[[common_pb2.TransportDescriptor], None] | None = None,
    ):
        """`on_announced`: called with each holder the control plane newly announced (and the puller accepted)."""
        self.worker, self.engine, self.puller = worker, worker.engine, puller
        self.on_announced = on_announced
        self._announced: set[bytes] = set()  # every holder descriptor seen, accepted or not

    def announce(self, holders: Iterable[common_pb2.TransportDescriptor]) -> None:
        """The holders the router announced (in its load polls, again and again): the ones new to this worker go to
        the puller, which vouches from now on for their leases only."""
        for holder in holders:
            key = holder.SerializeToString(deterministic=True)
            if key in self._announced:
                continue
            self._announced.add(key)
            try:
                accepted = self.puller.announce(holder)
            except DescriptorError as e:
                log.warning("side channel announcement unreadable", error=str(e))
                continue
            if accepted and self.on_announced is not None:
                self.on_announced(holder)

    def layout_problem(self, layout: common_pb2.StateLayout) -> str | None:
        """Why a state of `layout` cannot go into this worker's pools, or None."""
        if layout.compat_hash != self.worker.compat_hash:
            return f"incompatible state layout: holder {layout.compat_hash}, this worker {self.worker.compat_hash}"
        try:  # the regions are in the one-rank layout or the sender's rank parts; its ranks must split this model
            self.engine.check_sender_layout(layout.tensor_parallel_size or 1)
        except LayoutMismatch as e:
            return f"incompatible state layout: {e}"
        return None

    async def pull(
        self,
        lease: common_pb2.Lease,
        layout: common_pb2.StateLayout,
        transport: common_pb2.TransportDescriptor,
        room_wait_s: float,
    ) -> Pulled:
        """The state `lease` holds, pulled into pool space reserved here (waiting up to `room_wait_s` for room);
        raises PullFailed."""
        if problem := self.layout_problem(layout):
            raise PullFailed("layout", problem)
        if not lease.token:
            raise PullFailed("descriptor", "lease: its token is needed")
        try:  # nothing moves yet: a descriptor this worker cannot use is refused before any pool space is taken
            source = self.puller.source(transport, LeaseKey(lease.lease_id, lease.token), layout.region_bytes)
        except DescriptorError as e:
            raise PullFailed("descriptor", str(e)) from None
        parts = (layout.tensor_parallel_size or 1) if layout.rank_parts else 0
        reservation = await self._reserve(layout.num_tokens, parts, room_wait_s)
        self.worker.reservations += 1
        try:
            await reservation.wait_ready_async()  # a step launched before may still write this space
            stats = await self.puller.pull(
                source, [r.tensor for r in reservation.regions], self.worker.settings.transfer_timeout_s
            )
        except TransferError as e:
            self._release(lease.lease_id, reservation)
            raise PullFailed("transfer", f"state transfer failed: {e}", e.refused) from None
        except BaseException:
            self._release(lease.lease_id, reservation)
            raise
        finally:
            self.worker.reservations -= 1
        return Pulled(reservation, stats)

    def _release(self, lease_id: str, reservation: Reservation) -> None:
        """A failed pull's space goes back to the pool once the transport can no longer write into it."""
        self.puller.release_after(lease_id, lambda: self.engine.cancel_reservation(reservation))

    async def _reserve(self, num_tokens: int, sender_parts: int, wait_s: float) -> Reservation:
        """Pool space for the incoming state (`sender_parts`: see Engine.reserve); waits (bounded) while the pools
        are full."""
        deadline = time.monotonic() + wait_s
        delay = 0.002
        while True:
            try:
                return self.engine.reserve(num_tokens, sender_parts)
            except PoolExhausted as e:
                if time.monotonic() + delay > deadline:
                    raise PullFailed("no room", f"no pool space within {wait_s:g} s: {e}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)

"""Continuous batching with chunked prefill.

Each step takes, in order: every running request's next tokens (one for decodes, a chunk for prefills in
progress), then new requests from the queue, all under a token budget. A new request is admitted only
when a GDN slot and KV pages for its whole prompt are free (allocated as one best-fit run, so the prompt's
KV is usually one contiguous region). When a running request cannot grow its KV, the most recently admitted
running request is preempted: its state is freed and it is recomputed later (prompt + output so far), so a
shortage never corrupts another request's state.

With a prefix cache (prefix_cache.py), admission starts a request from the longest cached prefix of its prompt
that ends at a GDN checkpoint, prefill chunks end exactly where a checkpoint is to be taken, and allocation
evicts pages only the cache holds before it gives up (so the cache never causes a refusal or a preemption). A
waiting request whose prompt shares a prefix with one still prefilling waits for that one's checkpoint instead of
computing the prefix beside it (shared_prefill.py: n > 1 choices, a burst of one system prompt).

With async scheduling a step is scheduled while the previous one still runs: a request's token sampled there is
"pending" (counted, not yet known on the host) and its decode is scheduled all the same, unless that token
surely ends the request (see Request.last_token_pending). A request that turns out to have stopped wastes one
token of compute; its state is never advanced past a point another worker will pull from.

A request whose grammar (structured outputs) is still compiling runs all of its prompt but the token that samples,
then waits in the running list, scheduled nothing, until the grammar is ready (Request.may_sample).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import structlog

from deltamesh.engine import shared_prefill
from deltamesh.engine.cache import KVPagePool, PoolExhausted, StatePool
from deltamesh.engine.interfaces import PoolUsage, SchedulerInterface
from deltamesh.engine.prefix_cache import PrefixCache
from deltamesh.engine.request import Request, Status

log = structlog.get_logger("deltamesh.scheduler")


@dataclass
class ScheduledItem:
    request: Request
    num_tokens: int
    # A prefix-cache checkpoint position inside this chunk whose GDN state the step keeps in state slot
    # `snapshot_slot` on its way to the chunk's end (runner.host_step, models' GDN layers), or None.
    snapshot_at: int | None = None
    snapshot_slot: int | None = None
    # speculative decoding: the request's last token and the tokens drafted after it (num_tokens in all), verified
    verify: bool = False

    @property
    def samples(self) -> bool:
        """This step runs the request's last pending token, so a new token is sampled."""
        return self.verify or self.num_tokens == self.request.remaining


def _decoding(req: Request) -> bool:
    """It has its prompt computed and decodes one token at a time (or verifies drafts)."""
    return bool(req.output_ids) and req.num_computed >= len(req.prompt_ids) and req.remaining == 1


class Scheduler(SchedulerInterface):
    """One rank's scheduler, over that rank's pools."""

    def __init__(self, kv_pool: KVPagePool, state_pool: StatePool, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._num_preemptions = 0
        self.prefix_cache: PrefixCache | None = None
        self.snapshots = True  # steps may take checkpoints' states in passing (with a prefix cache: `_chunk`)
        # speculative decoding (engine/spec/): tokens drafted per request, and the decoding requests above which a
        # step decodes without them
        self.speculative_tokens, self.spec_disable_batch_size = 0, 0

    def alloc_pages(self, n: int, after: int | None = None) -> list[int]:
        """KV pages from the pool, evicting from the prefix cache if it is short (any thread)."""
        if self.prefix_cache is not None:
            return self.prefix_cache.alloc(n, after)
        return self.kv_pool.alloc(n, after)

    def reserve(self, num_tokens: int) -> tuple[int, int, list[int]]:
        """(rank, slot, pages) for an arriving `num_tokens` state, nothing written to them (any thread); raises
        PoolExhausted when they are not free. This scheduler's pools are rank 0's."""
        slot = self.state_pool.alloc(zeroed=False)
        try:
            return 0, slot, self.alloc_pages(self.kv_pool.pages_for(num_tokens))
        except PoolExhausted:
            self.state_pool.free(slot)
            raise

    def cancel(self, rank: int, slot: int, pages: list[int]) -> None:
        """Give back a `reserve`'s space."""
        self.kv_pool.free(pages)
        self.state_pool.free(slot)

    def _chunk(self, req: Request, budget: int, snapshot: bool) -> tuple[int, int | None]:
        """(tokens of `req` to run this step, a checkpoint position to take in passing or None): its rest, within
        the budget, ending at its next checkpoint, or running past it to the prompt's end when `snapshot` allows
        it and no checkpoint follows."""
        n = min(req.remaining, budget)
        if n == req.remaining and not req.may_sample:
            n -= 1  # its grammar still compiles: all but the token that samples (grammar.py)
        if self.prefix_cache is None:
            return n, None
        positions = self.prefix_cache.positions
        stop = positions.next_stop(req)
        if stop is None:
            return n, None
        # head and tail of 2 tokens or more: a 1-token piece would reach the GDN prefill kernels as a sequence of
        # one token, which they never get otherwise (a 1-token chunk runs as a decode)
        passing = (
            snapshot
            and req.num_computed + n == len(req.prompt_ids)
            and min(stop - req.num_computed, len(req.prompt_ids) - stop) >= 2
            and positions.next_stop(req, after=stop) is None
        )
        return (n, stop) if passing else (min(n, stop - req.num_computed), None)

    def add(self, request: Request) -> None:
        self._waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose state is already in the pools (received from a prefill worker)."""
        request.status = Status.RUNNING
        self._running.append(request)

    @property
    def running(self) -> list[Request]:
        return self._running

    @property
    def waiting(self) -> deque[Request]:
        return self._waiting

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def pools(self, rank: int) -> tuple[KVPagePool, StatePool]:
        assert rank == 0, rank  # a one-rank engine's, or the leader's of a tensor-parallel one
        return self.kv_pool, self.state_pool

    def usage(self) -> PoolUsage:
        kv, states = self.kv_pool, self.state_pool
        return PoolUsage(kv.num_used, kv.num_pages, states.num_used, states.num_slots)

    def schedule(self) -> list[ScheduledItem]:
        budget = self.max_num_batched_tokens
        items: list[ScheduledItem] = []

        def add(req: Request, n: int, at: int | None, verify: bool = False) -> None:
            nonlocal budget
            items.append(ScheduledItem(req, n, at, verify=verify))
            budget -= n

        k = self.speculative_tokens
        verify = k > 0 and sum(map(_decoding, self._running)) <= self.spec_disable_batch_size
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            if req.last_token_pending:
                i += 1
                continue
            verifies = verify and _decoding(req) and req.may_sample  # (else it waits for its grammar below)
            n, at = (k + 1, None) if verifies else self._chunk(req, budget, self.snapshots)
            if n == 0:  # waits for its grammar
                i += 1
                continue
            if not self._grow(req, req.num_computed + self.spec_reach(req, n, verifies)):
                continue  # req itself was preempted; running[i] is now the next request
            add(req, n, at, verifies)
            i += 1
        held = 0  # waiting requests left for a running prefill of their prefix (shared_prefill.py), in order
        while len(self._waiting) > held and budget > 0 and len(self._running) < self.max_num_seqs:
            req = self._waiting[held]
            if req.num_pending:  # a preempted request waits for its last token first
                break
            if self.prefix_cache is not None and shared_prefill.waits_for_a_prefill(
                req, self._running, self.prefix_cache
            ):
                held += 1
                if held == shared_prefill.MAX_HELD:
                    break
                continue
            if not self._admit(req):
                break
            del self._waiting[held]
            self._running.append(req)
            if self.prefix_cache is not None:
                ahead = itertools.islice(self._waiting, held + shared_prefill.MAX_HELD)
                shared_prefill.keep_prompt_checkpoint(req, ahead, self.prefix_cache)
            n, at = self._chunk(req, budget, self.snapshots)
            if n:
                add(req, n, at)
        self._snapshot_slots(items)
        return items

    def spec_reach(self, req: Request, n: int, verifies: bool = False) -> int:
        """The KV past `req`'s computed length that a step of `n` of its tokens may write: its tokens'; in a
        speculative engine a verifying request's K+1 inputs, moved on by up to K drafts its last step (launched,
        not read) accepted, then the MTP KV of its K-1 further drafts; a sampling prompt chunk's drafts likewise.
        The spare room every request is validated for (RequestBuilder) covers it."""
        k = self.speculative_tokens
        if not k or not (verifies or n == req.remaining):
            return n
        return n + (k if req.num_pending else 0) + k - 1

    @property
    def spare_tokens(self) -> int:
        """KV a request may write past its tokens (spec_reach) at most."""
        return 3 * self.speculative_tokens

    def _snapshot_slots(self, items: list[ScheduledItem]) -> None:
        """A state slot for each chunk that takes a checkpoint in passing: the scratch slot for the first, free
        slots (once admission has taken what it needs) for the others. A chunk left without one (every slot a
        request's: a full batch) runs on to its prompt's end without that checkpoint, as stopping there would
        cost its first token a whole step; but a chat's first message (a system prompt other users' conversations
        share) is worth the step: that chunk stops at its checkpoint."""
        scratch = True
        for it in items:
            if it.snapshot_at is None:
                continue
            if scratch:
                it.snapshot_slot, scratch = StatePool.SCRATCH, False
            elif self.state_pool.num_free:
                it.snapshot_slot = self.state_pool.alloc(zeroed=False)
            elif it.snapshot_at == it.request.turn_end:
                it.num_tokens, it.snapshot_at = it.snapshot_at - it.request.num_computed, None
            else:
                it.snapshot_at = None

    def release_snapshot_slots(self, items: list[ScheduledItem]) -> None:
        """Give back the free slots `_snapshot_slots` lent, once the copies out of them are queued (the stream
        runs them before any later use of the slots)."""
        for it in items:
            if it.snapshot_slot not in (None, StatePool.SCRATCH):
                self.state_pool.free(it.snapshot_slot)

    def _admit(self, req: Request) -> bool:
        if req.slot is not None:
            return self._admit_placed(req)
        cache = self.prefix_cache
        cached, tail = cache.acquire(req) if cache is not None else ([], None)
        # a speculative engine's prompt that samples in its first chunk drafts past it: room for that too
        need = self.kv_pool.pages_for(req.num_tokens + self.spec_reach(req, req.remaining) - req.remaining)
        need -= len(cached)
        free = self.kv_pool.num_free
        if cache is not None and free < need:  # walking the cache's blocks only when the pool is short
            free += cache.reclaimable()
        if self.state_pool.num_free == 0 or free < need:
            self.kv_pool.free(cached)
            if cache is not None:
                cache.release(tail)
            return False
        req.slot = self.state_pool.alloc(zeroed=not (cached or tail))
        req.pages = cached + self.alloc_pages(need)
        if cache is not None and (cached or tail):  # (only the cache gives cached pages or a tail)
            cache.restore(req, len(cached), tail)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed
        req.status = Status.RUNNING
        return True

    def _admit_placed(self, req: Request) -> bool:
        """A request whose first `num_computed` tokens' state is already in its slot and pages (pulled from
        another worker's prefix cache): pages for the rest of its prompt, then it goes on from there."""
        reach = self.spec_reach(req, req.remaining) - req.remaining
        need = self.kv_pool.pages_for(req.num_tokens + reach) - len(req.pages)
        free = self.kv_pool.num_free + (self.prefix_cache.reclaimable() if self.prefix_cache is not None else 0)
        if free < need:
            return False
        req.pages += self.alloc_pages(need, after=req.pages[-1] if req.pages else None)
        if self.prefix_cache is not None:
            req.turn_end = self.prefix_cache.positions.turn_end(req)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed
        req.status = Status.RUNNING
        return True

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make room for `num_tokens` of KV, preempting from the back of the running list if needed.
        False when `req` itself had to be preempted."""
        need = self.kv_pool.pages_for(num_tokens) - len(req.pages)
        while need > 0:
            try:
                req.pages += self.alloc_pages(need, after=req.pages[-1] if req.pages else None)
                return True
            except PoolExhausted:
                victim = self._running[-1]
                self.preempt(victim)
                if victim is req:
                    return False
        return True

    def preempt(self, req: Request) -> None:
        self._running.remove(req)
        self.free(req)
        req.num_computed = req.num_registered_pages = 0
        req.status = Status.WAITING
        self._waiting.appendleft(req)
        self._num_preemptions += 1
        log.warning("preempted", request_id=req.request_id, tokens=req.num_tokens)

    def free(self, req: Request) -> None:
        if req.slot is not None:
            self.state_pool.free(req.slot)
            req.slot = None
        self.kv_pool.free(req.pages)
        req.pages = []

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (finished or aborted); its state is not freed here."""
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)

"""Data-parallel attention: one engine over N ranks, each running its own requests.

Each rank holds the model whole except its MoE layers (parallel.py, `Shard.data_parallel`) and pools of its
own, and runs embedding, attention, GDN and the LM head for its own requests only. A MoE layer runs on every
rank's tokens: the ranks gather their tokens, each applies its part of the experts (whole experts with expert
parallelism, else their columns) to all of them, the partial sums are added up across the ranks and each rank
keeps its own rows. This is the decode layout of the disaggregated recipe (expert parallel + data-parallel
attention): KV and GDN state, which grow with the requests, are not replicated, and each expert's weights are
read once per step for the tokens of all ranks.

The leader (rank 0) schedules for every rank: one Scheduler per rank over that rank's pools (its own, and for
each follower a bookkeeping copy on the meta device whose writes go to that rank with its next step). A request
stays on the rank that admitted it. Every step the leader sends each rank its own inputs (engine/tp_workers.py),
and samples all ranks' tokens from their logits gathered. A rank without requests in a step still takes part
in its MoE layers' collectives (`HybridLM.idle`). The tokens a step samples go to every rank before the next
step (async scheduling takes the next inputs from them on the device).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from deltamesh.engine.cache import KVPagePool, PoolExhausted, StatePool
from deltamesh.engine.interfaces import PoolUsage, PrefixCacheInterface, SchedulerInterface
from deltamesh.engine.parallel import TensorParallelGroup
from deltamesh.engine.prefix_cache import PrefixCache
from deltamesh.engine.request import Request
from deltamesh.engine.scheduler import ScheduledItem, Scheduler
from deltamesh.engine.state_shards import RequestState
from deltamesh.engine.tp_handoff import Handoff, HandoffArea, Staged, rank_state, store_rank_state


class DataParallelGroup(TensorParallelGroup):
    """The collectives of a data-parallel engine (over all its ranks)."""

    # tokens of each rank in the current step: every rank knows all ranks' steps (run_rank), so no collective
    # and no wait for the device tells it
    counts: list[int] = []

    def moe(self, mlp, x: torch.Tensor, kernels) -> torch.Tensor:
        """A MoE layer over every rank's tokens; this rank's rows of its output."""
        import torch.distributed as dist

        counts, rank = self.counts, self.shard.rank
        assert x.shape[0] == counts[rank], (x.shape, counts)  # the step this rank runs is the one counted
        padded = x.new_zeros((max(counts), x.shape[1]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=self.group)
        out = self.all_reduce(mlp(torch.cat([p[:n] for p, n in zip(parts, counts)]), kernels))
        start = sum(counts[:rank])
        return out[start : start + counts[rank]]

    def gather_logits(self, logits: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """The leader gets every rank's logits [counts[r], V], in rank order (the others None)."""
        import torch.distributed as dist

        leader = self.shard.rank == 0
        if max(counts) == 0:
            return logits if leader else None
        padded = logits.new_zeros((max(counts), logits.shape[1]))
        padded[: logits.shape[0]] = logits
        parts = [torch.empty_like(padded) for _ in counts] if leader else None
        dist.gather(padded, parts, dst=0, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)]) if parts is not None else None

    def share_tokens(self, tokens: torch.Tensor | None, count: int, device: torch.device) -> torch.Tensor:
        """The leader's last sampled tokens (`count` of them), on every rank."""
        if tokens is None:
            tokens = torch.empty(count, dtype=torch.int64, device=device)
        return self.broadcast(tokens)


def run_rank(
    runner,
    group: DataParallelGroup,
    steps: list,
    rank: int,
    pending_count: int,
    pending_tokens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One rank's part of a data-parallel step: `steps` holds every rank's runner.HostStep (None: no requests),
    `pending_count` the number of tokens the previous step sampled when some step takes inputs from them. The
    leader gets every rank's logits, in rank order."""
    if pending_count:
        pending_tokens = group.share_tokens(pending_tokens, pending_count, runner.device)
    group.counts = [sum(s.query_lens) if s is not None else 0 for s in steps]
    step = steps[rank]
    logits = runner.run(step, pending_tokens) if step is not None else runner.idle()
    return group.gather_logits(logits, [len(s.sample_rows) if s is not None else 0 for s in steps])


def execute(runner, followers, items: list[ScheduledItem], pending_tokens: torch.Tensor | None) -> torch.Tensor:
    """The leader's step: every rank's items (ordered by rank) to its rank, the logits of all of them back."""
    by_rank: list[list[ScheduledItem]] = [[] for _ in range(followers.group.shard.size)]
    for it in items:
        by_rank[it.request.dp_rank].append(it)
    steps = [runner.host_step(mine) if mine else None for mine in by_rank]
    has_pending = any(s is not None and s.has_pending for s in steps)
    pending = pending_tokens.numel() if has_pending and pending_tokens is not None else 0
    followers.send_data_parallel_step(steps, pending)
    logits = run_rank(runner, followers.group, steps, 0, pending, pending_tokens)
    assert logits is not None, "the leader (rank 0) gathers every rank's logits"
    return logits


class DataParallelScheduler(SchedulerInterface):
    """One Scheduler per rank behind the scheduler's interface. A new request goes to the rank whose prefix cache
    holds the longest prefix of its prompt, if any; else (and an arriving state always) to the rank with the
    fewest requests (slots in use and waiting), ties taken in turn. It runs there until it ends (a preempted one
    waits there)."""

    def __init__(self, schedulers: list[Scheduler], pools: list[RankPools]):
        self.ranks, self.rank_pools = schedulers, pools
        self._lock = threading.Lock()  # reservations come from other threads
        self._next = 0  # where the next tie goes

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.ranks)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.ranks)

    def pools(self, rank: int) -> tuple[KVPagePool, StatePool]:
        return self.rank_pools[rank].kv, self.rank_pools[rank].states

    def usage(self) -> PoolUsage:
        return PoolUsage(*map(sum, zip(*(s.usage() for s in self.ranks))))

    def _pick(self, candidates: list[int]) -> int:
        load = {r: self.ranks[r].state_pool.num_used + len(self.ranks[r].waiting) for r in candidates}
        lowest, n = min(load.values()), len(self.ranks)
        rank = next(r for i in range(n) if load.get(r := (self._next + i) % n) == lowest)
        self._next = rank + 1
        return rank

    def add(self, request: Request) -> None:
        hits = [s.prefix_cache.hit_tokens(request) if s.prefix_cache else 0 for s in self.ranks]
        best = max(hits)
        with self._lock:
            request.dp_rank = self._pick([r for r, hit in enumerate(hits) if hit == best])
        self.ranks[request.dp_rank].add(request)

    def attach_prefix_caches(self, make) -> DataParallelPrefixCache:
        """A prefix cache per rank, over that rank's pools (`make(kv, states, checkpoints)`)."""
        caches = []
        for scheduler, pools in zip(self.ranks, self.rank_pools):
            scheduler.prefix_cache = make(pools.kv, pools.states, pools.checkpoints)
            caches.append(scheduler.prefix_cache)
        return DataParallelPrefixCache(caches)

    def add_running(self, request: Request) -> None:
        self.ranks[request.dp_rank].add_running(request)

    def schedule(self) -> list[ScheduledItem]:
        """Every rank's items, rank by rank (each rank under its own token budget)."""
        return [it for s in self.ranks for it in s.schedule()]

    def release_snapshot_slots(self, items: list[ScheduledItem]) -> None:
        for s in self.ranks:
            s.release_snapshot_slots([it for it in items if self.ranks[it.request.dp_rank] is s])

    def remove(self, req: Request) -> None:
        self.ranks[req.dp_rank].remove(req)

    def free(self, req: Request) -> None:
        self.ranks[req.dp_rank].free(req)

    def reserve(self, num_tokens: int) -> tuple[int, int, list[int]]:
        """Space on the least loaded rank that has it."""
        with self._lock:
            num_pages = self.ranks[0].kv_pool.pages_for(num_tokens)
            fits = [r for r, s in enumerate(self.ranks) if s.state_pool.num_free and s.kv_pool.num_free >= num_pages]
            if not fits:
                raise PoolExhausted(f"no rank has a free GDN state slot and {num_pages} free KV pages")
            rank = self._pick(fits)
            _, slot, pages = self.ranks[rank].reserve(num_tokens)
            return rank, slot, pages

    def cancel(self, rank: int, slot: int, pages: list[int]) -> None:
        self.ranks[rank].cancel(0, slot, pages)


class DataParallelPrefixCache(PrefixCacheInterface):
    """The ranks' prefix caches behind the prefix cache's interface: a request's own on its rank, the counts
    summed, the longest hit of any rank."""

    def __init__(self, caches: list[PrefixCache]):
        self.caches = caches

    def register(self, req: Request, snapshot_at: int | None = None, snapshot_slot: int | None = None) -> None:
        self.caches[req.dp_rank].register(req, snapshot_at, snapshot_slot)

    def register_finished(self, req: Request) -> None:
        self.caches[req.dp_rank].register_finished(req)

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        return max(c.cached_tokens(prompt_ids) for c in self.caches)

    def resume_keys(self) -> set[int]:
        return set().union(*(c.resume_keys() for c in self.caches))

    def reclaimable(self) -> int:
        return sum(c.reclaimable() for c in self.caches)

    def clear(self) -> None:
        for c in self.caches:
            c.clear()

    @property
    def num_pages(self) -> int:
        return sum(c.num_pages for c in self.caches)

    @property
    def num_checkpoints(self) -> int:
        return sum(c.num_checkpoints for c in self.caches)

    @property
    def num_bytes(self) -> int:
        return sum(c.num_bytes for c in self.caches)


@dataclass
class RankPools:
    """One rank's pools (the prefix cache's checkpoints: None without it)."""

    kv: KVPagePool
    states: StatePool
    checkpoints: StatePool | None

    def bookkeeping(self, ops: list) -> RankPools:
        """Pools shaped as these on the meta device (no memory): the leader's allocator of a follower's pools.
        Their writes (a slot zeroed for a new request; the prefix cache's copies) are recorded in `ops`, in
        order, for that rank to repeat before its next step."""
        meta = torch.device("meta")
        copies = RankPools(
            KVPagePool.shaped_like(self.kv, device=meta),
            StatePool.shaped_like(self.states, device=meta),
            self.checkpoints and StatePool.shaped_like(self.checkpoints, device=meta),
        )
        copies.states.name = "slots"
        if copies.checkpoints is not None:
            copies.checkpoints.name = "checkpoints"
        mirrored: tuple[KVPagePool | StatePool | None, ...] = (copies.kv, copies.states, copies.checkpoints)
        for pool in mirrored:
            if pool is not None:
                pool.mirror = ops
        return copies


class DataParallelHandoff(Handoff):
    """The leader's side of hand-offs: a held or arriving request's state, whichever rank holds it, in room taken
    in the hand-off area (tp_handoff.HandoffArea), moved between there and its rank point to point."""

    def _make_area(self) -> HandoffArea:
        return HandoffArea(
            KVPagePool.shaped_like(self.kv_pool, self.size.pages),
            StatePool.shaped_like(self.state_pool, self.size.states),
        )

    def gather(self, pages: list[int], slot: int, rank: int = 0) -> Staged:
        """A held request's state, from its rank into room taken in the area (stepping thread); PoolExhausted,
        before anything moves, when the area is full."""
        import torch.distributed as dist

        staged = self.stage(len(pages))
        if rank == 0:
            state = rank_state(self.kv_pool, self.state_pool, pages, slot)
        else:
            self.followers.send_point_to_point("send", rank, pages, slot)
            state = _empty_state(self.kv_pool, self.state_pool, len(pages))
            for t in state.tensors():
                dist.recv(t, src=rank, group=self.followers.group.group)
        self.area.write(staged, state)
        self._synchronize()
        return staged

    def scatter(self, pages: list[int], slot: int, rank: int, staged: Staged) -> None:
        """An arrived state, from the area into its rank's pools (stepping thread)."""
        import torch.distributed as dist

        state = self.area.read(staged)
        if rank == 0:
            store_rank_state(self.kv_pool, self.state_pool, pages, slot, state)
            return
        self.followers.send_point_to_point("recv", rank, pages, slot)
        for t in state.tensors():
            dist.send(t.contiguous(), dst=rank, group=self.followers.group.group)


def _empty_state(kv: KVPagePool, states: StatePool, num_pages: int) -> RequestState:
    return RequestState(
        kv.data.new_empty((num_pages, *kv.data.shape[1:])),
        torch.empty_like(states.conv[0]),
        torch.empty_like(states.recurrent[0]),
    )


def follow_point_to_point(
    group: DataParallelGroup, kv: KVPagePool, states: StatePool, direction: str, rank: int, pages: list[int], slot: int
) -> None:
    """A follower's side of a hand-off: the named rank sends its state of a request to the leader, or receives
    an arrived one from it; the other ranks have nothing to do."""
    import torch.distributed as dist

    if group.shard.rank != rank:
        return
    if direction == "send":
        for t in rank_state(kv, states, pages, slot).tensors():
            dist.send(t.contiguous(), dst=0, group=group.group)
        return
    state = _empty_state(kv, states, len(pages))
    for t in state.tensors():
        dist.recv(t, src=0, group=group.group)
    store_rank_state(kv, states, pages, slot, state)

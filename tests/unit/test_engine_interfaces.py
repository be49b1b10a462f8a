"""The step loop's two interfaces (engine/interfaces.py) as the data-parallel engine implements them over its
ranks' schedulers and prefix caches: counts summed over the ranks, each rank's own pools, the longest hit of any
rank. Real schedulers and caches over small CPU pools, no model and no processes."""

import pytest
import torch

from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.data_parallel import DataParallelPrefixCache, DataParallelScheduler, RankPools
from deltamesh.engine.interfaces import PoolUsage, PrefixCacheInterface, SchedulerInterface
from deltamesh.engine.prefix_cache import PrefixCache
from deltamesh.engine.request import Request, Status
from deltamesh.engine.sampling import SamplingParams
from deltamesh.engine.scheduler import Scheduler
from deltamesh.engine.stats import EngineStats

PAGE = 4


def rank_pools(kv_pages: int, slots: int) -> RankPools:
    cpu = torch.device("cpu")
    return RankPools(
        KVPagePool(kv_pages, PAGE, 1, 1, 4, torch.float32, cpu),
        StatePool(slots, 1, 8, 4, 1, 4, 4, torch.float32, torch.float32, cpu),
        StatePool(4, 1, 8, 4, 1, 4, 4, torch.float32, torch.float32, cpu),
    )


def two_ranks() -> tuple[DataParallelScheduler, list[RankPools]]:
    pools = [rank_pools(16, 3), rank_pools(24, 5)]
    schedulers = [Scheduler(p.kv, p.states, max_num_seqs=4, max_num_batched_tokens=64) for p in pools]
    return DataParallelScheduler(schedulers, pools), pools


def test_an_implementation_missing_a_method_is_refused_when_made():
    class Partial(SchedulerInterface):
        def schedule(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_the_data_parallel_scheduler_sums_its_ranks_and_names_each_ranks_pools():
    scheduler, pools = two_ranks()
    assert isinstance(scheduler, SchedulerInterface)
    assert scheduler.usage() == PoolUsage(0, 16 + 24, 0, 3 + 5)
    held = [scheduler.reserve(2 * PAGE) for _ in range(3)]  # the least loaded rank each time
    assert sorted(rank for rank, _, _ in held) == [0, 0, 1] or sorted(rank for rank, _, _ in held) == [0, 1, 1]
    assert scheduler.usage() == PoolUsage(3 * 2, 16 + 24, 3, 3 + 5)
    for rank in (0, 1):
        assert scheduler.pools(rank) == (pools[rank].kv, pools[rank].states)
        used = [r for r in held if r[0] == rank]
        assert pools[rank].kv.num_used == 2 * len(used) and pools[rank].states.num_used == len(used)
    for rank, slot, pages in held:
        scheduler.cancel(rank, slot, pages)
    assert scheduler.usage() == PoolUsage(0, 16 + 24, 0, 3 + 5)


def test_a_request_runs_on_the_rank_it_was_given():
    scheduler, pools = two_ranks()
    requests = [Request(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=2), None) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    assert len(scheduler.waiting) == 3 and scheduler.has_work
    items = scheduler.schedule()
    assert {it.request.request_id for it in items} == {"r0", "r1", "r2"}
    assert [len(s.running) for s in scheduler.ranks] == [2, 1] or [len(s.running) for s in scheduler.ranks] == [1, 2]
    for r in requests:
        assert r.status == Status.RUNNING and r in scheduler.ranks[r.dp_rank].running
        assert pools[r.dp_rank].states.num_used >= 1
    assert scheduler.usage().state_slots_used == 3
    for r in requests:
        scheduler.remove(r)
        scheduler.free(r)
    assert not scheduler.has_work and scheduler.usage() == PoolUsage(0, 16 + 24, 0, 3 + 5)


def test_the_data_parallel_prefix_cache_answers_for_its_ranks():
    scheduler, pools = two_ranks()
    stats = EngineStats()
    cache = scheduler.attach_prefix_caches(lambda kv, states, checkpoints: PrefixCache(kv, states, checkpoints, stats))
    assert isinstance(cache, DataParallelPrefixCache) and isinstance(cache, PrefixCacheInterface)
    assert [s.prefix_cache for s in scheduler.ranks] == cache.caches
    prompt = list(range(10, 10 + 2 * PAGE + 3))
    req = Request("a", prompt, SamplingParams(max_tokens=2), None)
    scheduler.add(req)
    [item] = scheduler.schedule()  # the whole prompt, the state after its full pages kept in passing
    assert (item.num_tokens, item.snapshot_at) == (len(prompt), 2 * PAGE)
    req.num_computed += item.num_tokens
    cache.register(req, item.snapshot_at, item.snapshot_slot)
    scheduler.release_snapshot_slots([item])
    rank = req.dp_rank
    assert cache.caches[rank].num_pages == 2 and cache.caches[1 - rank].num_pages == 0
    assert cache.num_pages == 2 and cache.num_checkpoints == cache.caches[rank].num_checkpoints == 1
    assert cache.num_bytes == cache.caches[rank].num_bytes > 0
    assert cache.cached_tokens(prompt + [7]) == 2 * PAGE  # the rank that holds it answers
    scheduler.remove(req)
    scheduler.free(req)
    assert cache.reclaimable() == 2
    cache.clear()
    assert cache.num_pages == cache.num_checkpoints == 0 and scheduler.usage().kv_pages_used == 0

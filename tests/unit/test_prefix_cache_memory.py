"""`--prefix-cache-memory`: one budget for the prefix cache's KV pages and GDN checkpoints together. Under it
the cache never holds more bytes than the budget after any step, makes room by evicting its least recently used
entries of either kind (never a pinned one), and outputs stay token-for-token those without a cache; the
checkpoint pool is sized from the budget; bad values are refused. The eviction order's packed rank and its
sort a chunk at a time give the order of a full sort."""

import math

import numpy as np
import pytest
from test_prefix_cache import FAMILIES, GREEDY, assert_cached_baseline, conversation, core, run_waves, tokens

from deltamesh.engine import EngineConfig
from deltamesh.engine.prefix_entries import eviction_rank, in_rank_order

PAGE_BYTES, SLOT_BYTES = 2048, 16896  # the test models' (fp32, page_size 4): checked in `budgeted`


@pytest.fixture(params=FAMILIES)
def model_dir(request, hf_checkpoints):
    return hf_checkpoints[request.param]


def gib(num_bytes: int) -> float:
    return num_bytes / 2**30


def budgeted(model_dir, budget: int, waves, **kw):
    """Runs `waves` without a cache and with one under `budget` bytes, checking the bytes the cache holds after
    every step; returns the cached engine and the entries it held at some step (block and tail keys)."""
    ref = run_waves(core(model_dir, False), waves, GREEDY)
    engine = core(model_dir, True, prefix_cache_memory_gb=gib(budget), **kw)
    cache = engine.prefix_cache
    assert (engine.kv_pool.page_bytes, engine.checkpoint_pool.slot_bytes) == (PAGE_BYTES, SLOT_BYTES)
    held = set()

    def check(engine):
        pages, checkpoints = cache.num_pages, cache.num_checkpoints
        assert cache.num_bytes == pages * PAGE_BYTES + checkpoints * SLOT_BYTES <= budget
        held.update(cache.entries.blocks, cache.entries.tails)

    assert run_waves(engine, waves, GREEDY, after_step=check) == ref
    return engine, held


def test_a_joint_budget_bounds_pages_and_checkpoints_and_evicts_both(model_dir):
    # a 22-token prompt and its reply leave 7 pages (a checkpoint at token 20) and a tail (3 tokens, a checkpoint):
    # 7 pages and 2 checkpoints, about what the budget holds, so each new prompt evicts the one before
    budget = 8 * PAGE_BYTES + 2 * SLOT_BYTES
    prompts = [tokens(22, 30 + i) for i in range(4)]
    waves = [[p] for p in prompts] + [[prompts[-1]], [prompts[0]]]
    # checkpoint slots to spare: what is evicted goes for the budget, not for want of a slot
    engine, held = budgeted(model_dir, budget, waves, prefix_cache_checkpoints=8)
    cache = engine.prefix_cache
    assert held - set(cache.entries.blocks) - set(cache.entries.tails)  # pages the cache held were evicted
    assert engine.stats.checkpoints_evicted > 0 and engine.stats.prefix_cache_hits >= 1
    assert cache.num_pages > 0 and cache.num_checkpoints > 0
    assert engine.loads()["prefix_cache_bytes"] == cache.num_bytes
    assert_cached_baseline(engine)


def test_a_budget_too_small_for_one_checkpoint_serves_without_hits(model_dir):
    budget = 3 * PAGE_BYTES  # a checkpoint (with the page it sits on) would not fit
    prompt = tokens(30, 1)
    engine, _ = budgeted(model_dir, budget, [[prompt], [prompt]])
    assert engine.checkpoint_pool.num_slots == 0  # sized from the budget: none would ever be used
    assert engine.stats.prefix_cache_hits == 0 and engine.stats.checkpoints_saved == 0
    assert 0 < engine.prefix_cache.num_pages <= 3
    assert_cached_baseline(engine)


def test_a_pinned_prefix_survives_the_budgets_eviction(hf_checkpoints):
    budget = 12 * PAGE_BYTES + 3 * SLOT_BYTES
    engine = core(hf_checkpoints["qwen3_5"], True, prefix_cache_memory_gb=gib(budget))
    assert engine.checkpoint_pool.num_slots == 3  # as many as fit with a page each (4 without the pages)
    history = tokens(13, 1)
    history += conversation(engine, [history], GREEDY)[0]
    pinned = engine.prefix_cache.pin(history + tokens(6, 2))
    evicted = engine.stats.checkpoints_evicted
    for i in range(4):  # other conversations that fill the budget many times over
        conversation(engine, [tokens(14, 10 + i), tokens(5, 20 + i)], GREEDY)
        assert engine.prefix_cache.num_bytes <= budget
    assert engine.stats.checkpoints_evicted > evicted
    assert engine.prefix_cache.cached_tokens(history + tokens(6, 2)) == pinned.num_tokens
    engine.prefix_cache.unpin(pinned)
    assert_cached_baseline(engine)


def test_checkpoint_slots_are_sized_from_the_budget():
    budget = 10 * (SLOT_BYTES + PAGE_BYTES) + SLOT_BYTES  # 10 checkpoints with their pages, and not quite 11

    def slots(**kw):
        return EngineConfig(**kw).resolved_prefix_cache_checkpoints(SLOT_BYTES, PAGE_BYTES, pool_pages=96)

    assert slots(max_num_seqs=8) == 16  # no budget: twice the requests
    assert slots(max_num_seqs=8, prefix_cache_memory_gb=gib(budget)) == 10
    assert slots(prefix_cache_memory_gb=gib(1000 * budget)) == 96  # no more than there can be pages
    assert slots(prefix_cache_memory_gb=gib(budget), prefix_cache_pages=4) == 4  # nor the cache may keep
    assert slots(prefix_cache_memory_gb=gib(budget), prefix_cache_checkpoints=3) == 3  # asked for: as asked


@pytest.mark.parametrize("gb", [0, -1, math.nan, math.inf])
def test_a_budget_that_is_not_a_positive_size_is_refused(gb):
    with pytest.raises(ValueError, match="prefix-cache-memory.*positive number of GiB"):
        EngineConfig(prefix_cache=True, prefix_cache_memory_gb=gb).validate()
    EngineConfig(prefix_cache=True, prefix_cache_memory_gb=0.5).validate()


def test_the_packed_eviction_rank_orders_as_the_four_keys_do():
    """Random entries with many ties in each key: sorting by the packed rank gives np.lexsort's order of
    (shared, last use, deepest first, tails before blocks)."""
    gen = np.random.default_rng(5)
    n = 5000
    shared, is_block = gen.random(n) < 0.3, gen.random(n) < 0.7
    last_use, depth = gen.integers(1, 50, n), gen.integers(0, 40, n).astype(np.int32)
    last_use[:3], depth[:3] = 2**40 - 1, 2**21 - 1  # the largest each keeps apart
    order = np.lexsort((is_block, -depth.astype(np.int64), last_use, shared))
    rank = eviction_rank(shared, last_use, depth, is_block)
    assert (np.argsort(rank, kind="stable") == order).all()


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_eviction_reads_the_same_order_a_chunk_at_a_time(chunk):
    """`in_rank_order` sorts only the lowest ranks it is read to (ties across a chunk's edge included): read to
    any depth it gives the stable sort's order, each item once."""
    gen = np.random.default_rng(chunk)
    items = gen.permutation(3000)
    rank = gen.integers(0, 200, 3000)  # ~15 ties per rank
    expected = items[np.argsort(rank, kind="stable")].tolist()
    assert list(in_rank_order(items, rank, chunk)) == expected
    some = min(chunk + 3, 3000)  # past the first chunk's edge
    read = in_rank_order(items, rank, chunk)
    assert [next(read) for _ in range(some)] == expected[:some]

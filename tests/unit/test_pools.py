import pytest
import torch

from deltamesh.engine.cache import KVPagePool, PoolExhausted, StatePool, page_runs


def kv_pool(n=16):
    return KVPagePool(n, 4, 2, 2, 8, torch.float32, torch.device("cpu"))


def test_pages_come_as_one_run_best_fit_and_are_counted():
    pool = kv_pool()
    a = pool.alloc(5)
    b = pool.alloc(3)
    assert page_runs(a) == [(1, 5)] and page_runs(b) == [(6, 3)]  # page 0 is the scratch page
    pool.free(a)
    c = pool.alloc(4)  # best fit: the 5-page hole, not the 8-page tail
    assert page_runs(c) == [(1, 4)]
    assert pool.num_used == 7 and pool.num_free == 9
    pool.free(b)
    pool.free(c)
    assert pool.num_used == 0


def test_growth_prefers_the_following_page_and_fragmented_alloc_still_succeeds():
    pool = kv_pool(8)
    a = pool.alloc(2)
    assert pool.alloc(1, after=a[-1]) == [3]
    holes = [pool.alloc(1) for _ in range(5)]
    for p in holes[::2]:
        pool.free(p)
    got = pool.alloc(3)  # only scattered single pages left
    assert len(page_runs(got)) == 3
    with pytest.raises(PoolExhausted):
        pool.alloc(1)


def test_double_free_is_refused():
    pool = kv_pool()
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(RuntimeError):
        pool.free(pages)


def test_regions_cover_exactly_the_request_pages():
    pool = kv_pool()
    pool.alloc(1)
    pages = pool.alloc(3)
    regions = pool.regions(pages)
    assert len(regions) == 1 and regions[0].nbytes == 3 * pool.page_bytes
    assert regions[0].tensor.data_ptr() == pool.data[pages[0]].data_ptr()


def test_state_slots_are_zeroed_and_slot_major():
    pool = StatePool(3, 4, 6, 4, 2, 8, 8, torch.float32, torch.float32, torch.device("cpu"))
    s = pool.alloc()
    pool.recurrent[s].fill_(1.0)
    pool.conv[s].fill_(1.0)
    pool.free(s)
    assert pool.alloc() == s
    assert pool.recurrent[s].abs().sum() == 0 and pool.conv[s].abs().sum() == 0
    # a slot that a state pull fills is not written at all (a zeroing kernel could land after the pull's copy)
    pool.recurrent[s].fill_(2.0)
    pool.free(s)
    assert pool.alloc(zeroed=False) == s and bool((pool.recurrent[s] == 2.0).all())
    conv, rec = pool.regions(s)
    assert rec.nbytes == 4 * 2 * 8 * 8 * 4  # every layer's state in one region
    flat_idx = pool.layer_rows(torch.tensor([s]))[3]
    assert pool.recurrent_flat[int(flat_idx)].data_ptr() == pool.recurrent[s, 3].data_ptr()
    pool.alloc(), pool.alloc()
    with pytest.raises(PoolExhausted):
        pool.alloc()


def _free_pages(pool) -> list[int]:
    return [p for p in range(1, pool.num_pages + 1) if pool._free[p]]


def test_the_free_runs_follow_every_allocation_and_free():
    """Random allocations (growing after a held page, or best fit) and frees: the runs the pool keeps are the
    runs of its free pages, and an allocation comes whole from one run wherever one is long enough."""
    import random

    rng = random.Random(7)
    pool = kv_pool(200)
    held: list[list[int]] = []
    for _ in range(2000):
        if rng.random() < (0.6 if pool.num_free > 50 else 0.3) and pool.num_free:
            n = rng.randint(1, min(12, pool.num_free))
            after = rng.choice(held)[-1] if held and rng.random() < 0.5 else None
            fits = max((length for _, length in page_runs(_free_pages(pool))), default=0) >= n
            pages = pool.alloc(n, after)
            assert len(set(pages)) == n and (len(page_runs(pages)) == 1 or not fits)
            held.append(pages)
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        free = _free_pages(pool)
        assert pool.num_free == len(free) and sorted(pool._runs._length_at.items()) == page_runs(free)


def test_the_pages_only_the_cache_holds_are_counted_as_references_change():
    """Requests allocating, sharing (cache hits among them) and freeing pages while the prefix cache takes and
    drops references of its own: the count of pages only the cache holds (what admission may reclaim) equals the
    count from the reference counts after every change."""
    import random

    rng = random.Random(3)
    pool = kv_pool(100)
    held: list[list[int]] = []
    cached: set[int] = set()
    for _ in range(2000):
        op = rng.random()
        if op < 0.3 and pool.num_free > 10:
            held.append(pool.alloc(rng.randint(1, 4)))
        elif op < 0.45 and (held or cached):  # another request shares a request's pages, or hits the cache
            pages = [rng.choice(sorted(cached))] if cached and (rng.random() < 0.5 or not held) else rng.choice(held)
            pool.share(pages)
            held.append(list(pages))
        elif op < 0.65 and held:  # the cache takes a reference on a request's page
            page = rng.choice(rng.choice(held))
            if page not in cached:
                pool.share([page])
                pool.note_cached(page, True)
                cached.add(page)
        elif op < 0.75 and cached:  # the cache drops one
            page = rng.choice(sorted(cached))
            pool.note_cached(page, False)
            pool.free([page])
            cached.discard(page)
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
        assert pool.num_cached_alone == sum(pool.refs(p) == 1 for p in cached)

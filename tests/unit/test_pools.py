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

"""The leak check every engine test shares: when no request is left, nothing is held but what the prefix cache
keeps (on by default), and that is all reclaimable."""


def assert_idle(holder) -> None:
    """`holder`: an EngineCore or a Scheduler. On every rank: no request holds a state slot or a KV page; the pages
    and checkpoints still in use are the prefix cache's own, and once it is cleared every pool is empty."""
    scheduler = getattr(holder, "scheduler", holder)
    for rank in getattr(scheduler, "ranks", [scheduler]):  # data parallel: one Scheduler per rank
        assert rank.state_pool.num_used == 0
        cache = rank.prefix_cache
        if cache is not None:
            assert rank.kv_pool.num_used == cache.num_pages == cache.reclaimable()
            assert cache.checkpoints.num_used == cache.num_checkpoints
            cache.clear()
            assert cache.checkpoints.num_used == 0
        assert rank.kv_pool.num_used == 0

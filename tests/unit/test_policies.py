"""Routing policies on real registry handles (no network: a handle's channel is only used to call a worker)."""

from deltamesh.services.router.policies import CacheAware, LeastLoaded
from deltamesh.services.router.registry import WorkerHandle
from deltamesh.v1 import common_pb2


def handle(address: str, inflight: int = 0) -> WorkerHandle:
    return WorkerHandle(
        address,
        "prefill",
        static=True,
        channel=None,
        healthy=True,
        inflight=inflight,
        load=common_pb2.WorkerLoad(address=address, kv_pages_total=100),
    )


def test_cache_aware_sends_a_shared_prefix_where_it_went_before():
    a, b = handle("a"), handle("b")
    policy = CacheAware(block=4)
    system = list(range(100, 140))  # a shared 40-token system prompt
    first = policy.pick([a, b], system + [1, 2, 3, 4])
    first.inflight += 3  # busier now, but within the balance
    assert policy.pick([a, b], system + [5, 6, 7, 8, 9]) is first
    assert policy.pick([a, b], list(range(500, 540))) is not first  # no shared prefix: the least loaded


def test_cache_aware_falls_back_to_load_when_the_cached_worker_is_too_busy_or_the_match_short():
    a, b = handle("a"), handle("b")
    policy = CacheAware(block=4, balance=2)
    prompt = list(range(40))
    first = policy.pick([a, b], prompt)
    other = b if first is a else a
    first.inflight = 5
    assert policy.pick([a, b], prompt) is other  # 5 more requests than the other: load wins
    first.inflight = 0
    assert policy.pick([a, b], prompt[:8] + list(range(900, 932))) is LeastLoaded().pick([a, b])  # 8 of 40 tokens


def test_cache_aware_forgets_the_oldest_blocks_beyond_its_budget():
    a, b = handle("a"), handle("b")
    policy = CacheAware(block=4, max_blocks=10)
    old = list(range(40))
    went = policy.pick([a, b], old)
    went.inflight += 1
    for i in range(5):
        policy.pick([went], list(range(1000 + 40 * i, 1040 + 40 * i)))  # 50 newer blocks sent to the same worker
    went.inflight = 1
    assert policy.pick([a, b], old) is not went  # forgotten: the least loaded


def test_pd_decider_sends_a_conversations_next_turn_to_the_decode_worker_that_holds_it():
    from deltamesh.services.router.pd_decider import PdDecider

    a, b = handle("a"), handle("b")
    a.load.prefix_cache = b.load.prefix_cache = True
    pd = PdDecider(max_suffix=10, block=4)
    turn_1 = list(range(100, 140))
    reply = list(range(300, 312))
    pd.finished("b", turn_1 + reply)
    assert pd.direct([a, b], turn_1 + reply + [1, 2, 3, 4, 5]) is b  # 5 new tokens (+ none unmatched)
    assert pd.direct([a, b], turn_1 + reply + list(range(20))) is None  # 20 new tokens: through prefill
    assert pd.direct([a, b], list(range(500, 540))) is None  # nothing held anywhere
    assert pd.direct([a], turn_1 + reply + [1]) is None  # the holder is not among the healthy workers
    b.load.prefix_cache = False  # restarted without --prefix-cache: it holds nothing
    assert pd.direct([a, b], turn_1 + reply + [1]) is None
    b.load.prefix_cache = True
    pd.forget("b")  # it failed: its cache is gone
    assert pd.direct([a, b], turn_1 + reply + [1]) is None

"""The routing decision without a look at every worker (router/load_order.py, policies.CacheAware): on a registry's
real handles, whose counts change as legs.py and admission.py change them, the least loaded worker and the
cache-aware choice are what scoring every candidate (the decision before, written out here) chooses."""

import random

from deltamesh.protocol.blocks import block_keys
from deltamesh.services.router.load_order import Pool, load_score
from deltamesh.services.router.policies import CacheAware
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.v1 import common_pb2

BLOCK = 4


def registry_of(n: int, rng: random.Random) -> WorkerRegistry:
    registry = WorkerRegistry(0.5, 1.0, "s" * 32)
    for i in range(n):
        load = common_pb2.WorkerLoad(running=rng.randrange(6), kv_pages_used=rng.randrange(50), kv_pages_total=100)
        registry.keep(WorkerHandle(f"w{i:03d}", "prefill", static=True, channel=None, healthy=True, load=load))
    return registry


def scored_every_candidate(policy: CacheAware, candidates: list[WorkerHandle], prompt: list[int]):
    """The decision as it was made before: every candidate scored. (chosen, its matched blocks)."""
    keys = block_keys(prompt, BLOCK)
    held = policy.index.matched(keys) if keys else {}
    sent = policy.sent.matched(keys) if keys else {}
    matched = {w.address: max(held.get(w.address, 0), sent.get(w.address, 0)) for w in candidates}
    least = min(candidates, key=load_score)
    best = max(candidates, key=lambda w: (matched[w.address], -load_score(w)[0]))
    longest = matched[best.address]
    busier = load_score(best)[0] - load_score(least)[0]
    use_cache = longest > 0 and longest >= policy.min_match * len(keys) and busier <= policy.balance
    return (best if use_cache else least), matched


def jostle(registry: WorkerRegistry, rng: random.Random) -> None:
    """Counts change as requests come and go and reports arrive; a worker fails or comes back now and then."""
    for w in rng.sample(list(registry.workers.values()), 10):
        what = rng.randrange(5)
        if what == 0:
            w.inflight += 1
        elif what == 1 and w.inflight:
            w.inflight -= 1
        elif what == 2:
            w.admitted = rng.randrange(4)
        elif what == 3:
            w.load = common_pb2.WorkerLoad(
                running=rng.randrange(6), waiting=rng.randrange(2), kv_pages_used=rng.randrange(100), kv_pages_total=100
            )
        else:
            w.healthy = not w.healthy or rng.random() < 0.5


def test_the_least_loaded_is_found_in_the_order_as_counts_change():
    rng = random.Random(1)
    registry = registry_of(60, rng)
    for _ in range(300):
        jostle(registry, rng)
        healthy = registry.healthy("prefill")
        assert registry.pool("prefill").least_loaded() is min(healthy, key=load_score)
        tried = {w.address for w in rng.sample(healthy, min(5, len(healthy)))}
        rest = [w for w in healthy if w.address not in tried]
        got = registry.pool("prefill", lambda w: w.address not in tried).least_loaded()
        assert got is (min(rest, key=load_score) if rest else None)


def test_a_dropped_worker_leaves_its_order():
    import asyncio

    async def run():
        registry = registry_of(3, random.Random(2))
        first = registry.pool("prefill").least_loaded()
        registry._drop(first)
        assert registry.pool("prefill").least_loaded() is not first
        first.inflight = 0  # a request on it ends after the drop: it stays out
        assert first.address not in {w.address for w in registry.pool("prefill").workers()}
        await asyncio.gather(*registry._closing, return_exceptions=True)

    asyncio.run(run())


def test_cache_aware_chooses_as_scoring_every_candidate_did():
    """Prompts held by some workers (reported, or sent by this process), some of those overloaded, and prompts no
    one holds: the holder when it is not too busy, else the least loaded, as before."""
    rng = random.Random(3)
    registry = registry_of(80, rng)
    index = PrefixIndex()
    policy = CacheAware(block=BLOCK, balance=3, index=index)
    prompts = [[rng.randrange(1, 5000) for _ in range(rng.choice([8, 40, 80]))] for _ in range(40)]
    for prompt in prompts[:20]:  # held: the whole prompt, or half of it, by one or two workers
        for w in rng.sample(list(registry.workers.values()), rng.choice([1, 2])):
            keys = block_keys(prompt, BLOCK)
            index.add(w.address, keys if rng.random() < 0.7 else keys[: len(keys) // 2])
    outcomes = {"holder": 0, "busy holder skipped": 0, "least loaded": 0}
    for _ in range(400):
        jostle(registry, rng)
        prompt = rng.choice(prompts)
        candidates = registry.healthy("prefill")
        want, matched = scored_every_candidate(policy, candidates, prompt)
        got = policy.pick(registry.pool("prefill"), prompt)
        # equally loaded holders of the same prefix may be chosen either way; every other choice is the same
        assert (matched[got.address], load_score(got)[0]) == (matched[want.address], load_score(want)[0])
        least = min(candidates, key=load_score)
        if matched[got.address]:
            outcomes["holder"] += 1
        else:
            assert got is least
            outcomes["busy holder skipped" if max(matched.values()) else "least loaded"] += 1
    assert all(n >= 20 for n in outcomes.values()), outcomes  # each case met often enough to count


def test_what_this_process_sent_counts_to_the_deepest_block_sent():
    policy = CacheAware(block=BLOCK)
    a, b = (WorkerHandle(x, "prefill", static=True, channel=None, healthy=True) for x in "ab")
    conversation = list(range(100, 140))
    went = policy.pick(Pool.of([a, b]), conversation)
    went.inflight = 2  # busier, within the balance
    assert policy.pick(Pool.of([a, b]), conversation + [7, 8, 9, 10]) is went
    assert policy.sent.matched(block_keys(conversation + [7, 8, 9, 10], BLOCK)) == {went.address: 11}

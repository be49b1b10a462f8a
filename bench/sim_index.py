"""The router's prefix index and routing decision at scale, by SIMULATION, in one process (no network, no model):
a PrefixIndex (deltamesh/services/router/prefix_index.py) filled as --workers workers' reports would fill it, each
with --keys random cached-prefix keys, then the cache-aware routing decision over all of them, timed one by one.

    python bench/router_sim.py index --workers 1000 --keys 10000

What is measured: the index's memory (the process's RSS before and after filling it) and fill time; one prompt's
lookup (`PrefixIndex.matched` over its block keys) for a prompt one worker holds and for one nobody holds; and the
whole decision a router process makes per request (the prompt's block keys, the lookup, CacheAware's pick from the
pool of every worker's handle, kept in load order as a router's registry keeps it), p50/p99. The keys are distinct
per worker (no two workers cache the same prefix): the largest index for that many entries."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from deltamesh.protocol.blocks import block_keys
from deltamesh.services.router.load_order import Pool
from deltamesh.services.router.policies import CacheAware
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.services.router.registry import WorkerHandle
from deltamesh.v1 import common_pb2

BLOCK = 16


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_index(workers: int, keys: int, prompt_tokens: int, decisions: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    addresses = [f"10.{i // 250}.{i % 250}.1:50061" for i in range(workers)]
    rss0, t0 = rss_mib(), time.perf_counter()
    index = PrefixIndex()
    for address in addresses:
        index.replace(address, [rng.getrandbits(63) for _ in range(keys)])
    fill_s, rss1 = time.perf_counter() - t0, rss_mib()

    # a prompt some worker holds: its keys are put in that worker's reports, as a worker caching it would
    prompts = [[rng.randrange(1, 150_000) for _ in range(prompt_tokens)] for _ in range(64)]
    for i, prompt in enumerate(prompts[:32]):
        index.add(addresses[i * 7 % workers], block_keys(prompt, BLOCK))
    handles = [
        WorkerHandle(
            a,
            "prefill",
            static=True,
            channel=None,
            healthy=True,
            load=common_pb2.WorkerLoad(address=a, running=rng.randrange(4), kv_pages_total=1000),
        )
        for a in addresses
    ]
    policy = CacheAware(block=BLOCK, index=index)
    pool = Pool.of(handles)  # ordered once: a router's registry keeps its pools ordered as loads change
    hit_keys, miss_keys = block_keys(prompts[0], BLOCK), block_keys(prompts[40], BLOCK)
    lookups = {"hit": [], "miss": []}
    for _ in range(2000):
        for name, ks in (("hit", hit_keys), ("miss", miss_keys)):
            t = time.perf_counter()
            index.matched(ks)
            lookups[name].append(time.perf_counter() - t)
    picks, chose_holder = [], 0
    for i in range(decisions):
        prompt = prompts[i % len(prompts)]
        t = time.perf_counter()
        chosen = policy.pick(pool, prompt)
        picks.append(time.perf_counter() - t)
        chose_holder += i % len(prompts) < 32 and chosen.address == addresses[(i % len(prompts)) * 7 % workers]
    return {
        "workers": workers,
        "keys_per_worker": keys,
        "entries": index.entries(),
        "distinct_keys": len(index),
        "fill_s": round(fill_s, 2),
        "index_rss_mib": round(rss1 - rss0, 1),
        "bytes_per_entry": round((rss1 - rss0) * 2**20 / max(index.entries(), 1), 1),
        "prompt_tokens": prompt_tokens,
        "lookup_hit_us": round(1e6 * statistics.median(lookups["hit"]), 1),
        "lookup_miss_us": round(1e6 * statistics.median(lookups["miss"]), 1),
        "decision_p50_us": round(1e6 * percentile(picks, 0.5), 1),
        "decision_p99_us": round(1e6 * percentile(picks, 0.99), 1),
        # the first 32 prompts are held by one worker each: cache-aware must send each there (a check, not a timing)
        "decisions_to_holder": f"{chose_holder}/{sum(i % len(prompts) < 32 for i in range(decisions))}",
    }

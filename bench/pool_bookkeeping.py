"""Host cost of the KV pool's bookkeeping as the pool grows (CPU; no model): allocating and freeing pages in a
fragmented pool, and ordering the prefix cache's entries for an eviction batch (the 1/64 of the cache that an
eviction frees beyond its need).

    .venv/bin/python bench/pool_bookkeeping.py --out bench/results/pool_bookkeeping.json

The pool has tiny pages (its tensor is not what is measured). Fragmented: filled with runs of 1-64 pages, then
every other run freed. Eviction order: every page cached, a tenth of them shared with a request, random last uses
and depths, ranked and read in order as `CacheEntries.eviction_order` does (prefix_entries.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ints, median, print_table, write_result
from deltamesh.engine.cache import KVPagePool
from deltamesh.engine.prefix_entries import EVICTION_SLACK, eviction_rank, in_rank_order


def fragmented_pool(num_pages: int, rng: random.Random) -> KVPagePool:
    pool = KVPagePool(num_pages, 1, 1, 1, 1, torch.float32, torch.device("cpu"))
    held = []
    while pool.num_free > num_pages // 4:
        held.append(pool.alloc(rng.randint(1, 64)))
    for pages in held[::2]:
        pool.free(pages)
    return pool


def alloc_free_us(pool: KVPagePool, rng: random.Random, n: int) -> float:
    for _ in range(n // 10):  # warm-up
        pool.free(pool.alloc(rng.randint(1, 64)))
    start = time.perf_counter()
    for _ in range(n):
        pool.free(pool.alloc(rng.randint(1, 64)))
    return (time.perf_counter() - start) / n * 1e6


def eviction_order_ms(num_pages: int, gen: np.random.Generator, reps: int) -> float:
    pool = KVPagePool(num_pages, 1, 1, 1, 1, torch.float32, torch.device("cpu"))
    for page in pool.alloc(num_pages):
        pool.note_cached(page, True)
    pool.share(gen.choice(np.arange(1, num_pages + 1), num_pages // 10, replace=False).tolist())
    last_use = gen.integers(1, 10 * num_pages, num_pages + 1)
    depth = gen.integers(0, 2048, num_pages + 1).astype(np.int32)
    is_block = gen.random(num_pages + 1) < 0.9
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        pages = pool.cached_pages
        shared = pool.ref_counts[pages] > 1
        pages, shared = pages[~shared], shared[~shared]
        order = in_rank_order(pages, eviction_rank(shared, last_use[pages], depth[pages], is_block[pages]))
        for _ in range(num_pages // EVICTION_SLACK):
            next(order)
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=ints, default=[8_000, 65_000, 200_000, 1_000_000])
    ap.add_argument("--allocs", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "pool_bookkeeping.json"))
    args = ap.parse_args()
    rows = []
    for n in args.pages:
        rng, gen = random.Random(0), np.random.default_rng(0)
        rows.append(
            {
                "pages": n,
                "alloc_free_us": round(alloc_free_us(fragmented_pool(n, rng), rng, args.allocs), 1),
                "eviction_order_ms": round(eviction_order_ms(n, gen, args.reps), 2),
            }
        )
        print(rows[-1], flush=True)
    print_table(rows, ["pages", "alloc_free_us", "eviction_order_ms"])
    print(write_result(args.out, {"rows": rows}))


if __name__ == "__main__":
    main()

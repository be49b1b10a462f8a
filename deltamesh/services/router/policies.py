"""Routing policies: pick one worker out of the healthy candidates (for a request's prompt, where a policy cares).

A router of several processes (--api-server-count), or several routers, share the workers: what a policy weighs is
what every router process sees alike (the workers' reported loads and cached prefixes, router/prefix_index.py) and
what this process has sent since (its requests in flight, the prefixes it sent), so that a repeated prefix goes to
the same worker from any process.

A decision looks at the prompt's holders and at the least loaded worker of the pool (router/load_order.py), never at
every worker: its cost does not grow with the mesh."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from deltamesh.protocol.blocks import block_keys
from deltamesh.services.router import metrics
from deltamesh.services.router.load_order import Pool, as_pool, load_score
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.services.router.registry import WorkerHandle

Candidates = Pool | Iterable[WorkerHandle]  # a router passes its pools; a list of handles is ordered on the spot


class Policy(Protocol):
    def pick(self, candidates: Candidates, prompt_ids: Sequence[int] = ()) -> WorkerHandle | None:
        """One of the candidates (None when there is none)."""


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, candidates: Candidates, prompt_ids: Sequence[int] = ()) -> WorkerHandle | None:
        ordered = sorted(as_pool(candidates).workers(), key=lambda w: w.address)
        return ordered[next(self._counter) % len(ordered)] if ordered else None


class LeastLoaded:
    """Fewest requests (load_order.load_score: this process's requests in flight or admitted, or the worker's
    reported ones, whichever is more), then the lowest KV-page use."""

    def pick(self, candidates: Candidates, prompt_ids: Sequence[int] = ()) -> WorkerHandle | None:
        return as_pool(candidates).least_loaded()


class SentBlocks:
    """What the router has sent each worker, remembered the way a worker's prefix cache names it: hash chains of
    `block`-token blocks, the `max_blocks` most recent per worker; looked up as the workers' reports are
    (router/prefix_index.py), so that a prompt's holders cost a probe per block, not a look at every worker."""

    def __init__(self, block: int = 16, max_blocks: int = 1 << 18):
        self.block, self.max_blocks = block, max_blocks
        self._sent: dict[str, OrderedDict[int, None]] = {}  # each worker's keys, oldest first: what to forget
        self._index = PrefixIndex()

    def keys(self, ids: Sequence[int]) -> list[int]:
        return block_keys(ids, self.block)

    def matched(self, keys: list[int]) -> dict[str, int]:
        """Each worker sent some of `keys` (a prompt's, first to last), with how many blocks of the prompt it can
        resume after: the depth of the deepest key sent there (a key names its whole prefix)."""
        return self._index.matched(keys)

    def remember(self, address: str, keys: list[int]) -> None:
        sent = self._sent.setdefault(address, OrderedDict())
        new = [k for k in keys if k not in sent]
        for k in keys:
            sent[k] = None
            sent.move_to_end(k)
        forgotten = []
        while len(sent) > self.max_blocks:
            forgotten.append(sent.popitem(last=False)[0])
        self._index.add(address, new)
        self._index.remove(address, forgotten)

    def forget(self, address: str) -> None:
        self._sent.pop(address, None)
        self._index.forget(address)


def longest_held(
    pool: Pool, keys: list[int], reported: PrefixIndex | None, sent: SentBlocks, usable=lambda w: True
) -> tuple[WorkerHandle | None, int]:
    """The worker of `pool` (and `usable`) that holds the longest prefix of a prompt's `keys`, as its reports say or
    as this process sent it, and how many blocks; the least loaded of those that hold as many; (None, 0) if none
    holds any. Only the holders are looked at: a probe per block of the prompt, whatever the number of workers."""
    depths = reported.matched(keys) if reported is not None and keys else {}
    for address, n in (sent.matched(keys) if keys else {}).items():
        if n > depths.get(address, 0):
            depths[address] = n
    best, longest = None, 0
    for address, n in depths.items():
        if n < longest:
            continue
        w = pool.get(address)
        if w is None or not usable(w):
            continue
        if best is None or n > longest or load_score(w) < load_score(best):
            best, longest = w, n
    return best, longest


class CacheAware:
    """The worker that can resume the longest prefix of this prompt from its cache (as the workers report it, or as
    this process sent it there since), unless that worker is busier than the least loaded one by more than `balance`
    requests or the match is short; else the least loaded."""

    def __init__(
        self,
        block: int = 16,
        min_match: float = 0.5,
        balance: int = 8,
        max_blocks: int = 1 << 18,
        index: PrefixIndex | None = None,
    ):
        """`index`: the workers' reported prefixes (None: only what this process sent)."""
        self.min_match, self.balance = min_match, balance
        self.sent = SentBlocks(block, max_blocks)
        self.index = index

    def pick(self, candidates: Candidates, prompt_ids: Sequence[int] = ()) -> WorkerHandle | None:
        pool = as_pool(candidates)
        least = pool.least_loaded()
        if least is None:
            return None
        keys = self.sent.keys(prompt_ids)
        best, longest = longest_held(pool, keys, self.index, self.sent)
        use_cache = (
            best is not None
            and longest >= self.min_match * len(keys)
            and load_score(best)[0] - load_score(least)[0] <= self.balance
        )
        chosen = best if best is not None and use_cache else least
        metrics.ROUTING_DECISIONS.labels("cache" if use_cache else "load").inc()
        self.sent.remember(chosen.address, keys)
        return chosen


POLICIES: dict[str, type[Policy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str, page_size: int, index: PrefixIndex | None = None) -> Policy:
    """The policy `name`; cache_aware names prefixes in blocks of the workers' KV page size, as their caches do, and
    reads what they hold from `index`."""
    return CacheAware(block=page_size, index=index) if name == "cache_aware" else POLICIES[name]()

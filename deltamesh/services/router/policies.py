"""Routing policies: pick one worker out of the healthy candidates (for a request's prompt, where a policy cares).

A router of several processes (--api-server-count), or several routers, share the workers: what a policy weighs is
what every router process sees alike (the workers' reported loads and cached prefixes, router/prefix_index.py) and
what this process has sent since (its requests in flight, the prefixes it sent), so that a repeated prefix goes to
the same worker from any process."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from deltamesh.protocol.blocks import block_keys
from deltamesh.services.router import metrics
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.services.router.registry import WorkerHandle


class Policy(Protocol):
    def pick(self, candidates: list[WorkerHandle], prompt_ids: Sequence[int] = ()) -> WorkerHandle: ...


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def pick(self, candidates: list[WorkerHandle], prompt_ids: Sequence[int] = ()) -> WorkerHandle:
        ordered = sorted(candidates, key=lambda w: w.address)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoaded:
    """Fewest requests: the most of what this router process has sent or admitted and not seen end, and of what the
    worker last reported running and queued (every router's requests, as of its report); then the lowest KV-page
    use."""

    def pick(self, candidates: list[WorkerHandle], prompt_ids: Sequence[int] = ()) -> WorkerHandle:
        return min(candidates, key=_load_score)


def _load_score(w: WorkerHandle):
    load = w.load
    reported = load.running + load.waiting if load else 0
    kv = load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0
    # a decode worker's admitted requests include those still prefilling elsewhere: bound here, not yet sent
    return (max(w.inflight, w.admitted, reported), kv, w.address)


class SentBlocks:
    """What the router has sent each worker, remembered the way a worker's prefix cache names it: hash chains of
    `block`-token blocks, the `max_blocks` most recent per worker."""

    def __init__(self, block: int = 16, max_blocks: int = 1 << 18):
        self.block, self.max_blocks = block, max_blocks
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def keys(self, ids: Sequence[int]) -> list[int]:
        return block_keys(ids, self.block)

    def matched(self, address: str, keys: list[int]) -> int:
        """How many of `keys`, from the first, went to the worker at `address`."""
        sent = self._sent.get(address, OrderedDict())
        n = 0
        while n < len(keys) and keys[n] in sent:
            n += 1
        return n

    def remember(self, address: str, keys: list[int]) -> None:
        sent = self._sent.setdefault(address, OrderedDict())
        for k in keys:
            sent[k] = None
            sent.move_to_end(k)
        while len(sent) > self.max_blocks:
            sent.popitem(last=False)

    def forget(self, address: str) -> None:
        self._sent.pop(address, None)


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

    def pick(self, candidates: list[WorkerHandle], prompt_ids: Sequence[int] = ()) -> WorkerHandle:
        keys = self.sent.keys(prompt_ids)
        least = min(candidates, key=_load_score)
        held = self.index.matched(keys) if self.index is not None and keys else {}
        matched = {w.address: max(held.get(w.address, 0), self.sent.matched(w.address, keys)) for w in candidates}
        best = max(candidates, key=lambda w: (matched[w.address], -_load_score(w)[0]))
        busier = _load_score(best)[0] - _load_score(least)[0]
        longest = matched[best.address]
        use_cache = longest > 0 and longest >= self.min_match * len(keys) and busier <= self.balance
        chosen = best if use_cache else least
        metrics.ROUTING_DECISIONS.labels("cache" if use_cache else "load").inc()
        self.sent.remember(chosen.address, keys)
        return chosen


POLICIES: dict[str, type[Policy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str, page_size: int, index: PrefixIndex | None = None) -> Policy:
    """The policy `name`; cache_aware names prefixes in blocks of the workers' KV page size, as their caches do, and
    reads what they hold from `index`."""
    return CacheAware(block=page_size, index=index) if name == "cache_aware" else POLICIES[name]()

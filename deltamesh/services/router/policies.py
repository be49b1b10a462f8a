"""Routing policies: pick one worker out of the healthy candidates (for a request's prompt, where a policy cares)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from deltamesh.protocol.blocks import block_key
from deltamesh.services.router import metrics
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
    """Fewest requests in flight (what the router has sent or admitted and not seen end, plus what the worker last
    reported queued), then the lowest KV-page use."""

    def pick(self, candidates: list[WorkerHandle], prompt_ids: Sequence[int] = ()) -> WorkerHandle:
        return min(candidates, key=_load_score)


def _load_score(w: WorkerHandle):
    load = w.load
    queued = load.waiting if load else 0
    kv = load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0
    # a decode worker's admitted requests include those still prefilling elsewhere: bound here, not yet sent
    return (max(w.inflight, w.admitted) + queued, kv, w.address)


class SentBlocks:
    """What the router has sent each worker, remembered the way a worker's prefix cache names it: hash chains of
    `block`-token blocks, the `max_blocks` most recent per worker."""

    def __init__(self, block: int = 16, max_blocks: int = 1 << 18):
        self.block, self.max_blocks = block, max_blocks
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def keys(self, ids: Sequence[int]) -> list[int]:
        keys, parent = [], None
        for i in range(len(ids) // self.block):
            parent = block_key(parent, ids[i * self.block : (i + 1) * self.block])
            keys.append(parent)
        return keys

    def matched(self, address: str, keys: list[int]) -> int:
        """How many of `keys`, from the first, went to the worker at `address`."""
        sent = self._sent.get(address, {})
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
    """The worker that was sent the longest prefix of this prompt (so its prefix cache likely holds it), unless
    that worker is busier than the least loaded one by more than `balance` requests or the match is short; else
    the least loaded."""

    def __init__(self, block: int = 16, min_match: float = 0.5, balance: int = 8, max_blocks: int = 1 << 18):
        self.min_match, self.balance = min_match, balance
        self.sent = SentBlocks(block, max_blocks)

    def pick(self, candidates: list[WorkerHandle], prompt_ids: Sequence[int] = ()) -> WorkerHandle:
        keys = self.sent.keys(prompt_ids)
        least = min(candidates, key=_load_score)
        matched = {w.address: self.sent.matched(w.address, keys) for w in candidates}
        best = max(candidates, key=lambda w: (matched[w.address], -_load_score(w)[0]))
        busier = _load_score(best)[0] - _load_score(least)[0]
        longest = matched[best.address]
        use_cache = longest > 0 and longest >= self.min_match * len(keys) and busier <= self.balance
        chosen = best if use_cache else least
        metrics.ROUTING_DECISIONS.labels("cache" if use_cache else "load").inc()
        self.sent.remember(chosen.address, keys)
        return chosen


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str, page_size: int) -> Policy:
    """The policy `name`; cache_aware names prefixes in blocks of the workers' KV page size, as their caches do."""
    return CacheAware(block=page_size) if name == "cache_aware" else POLICIES[name]()

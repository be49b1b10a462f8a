"""Exact prefix caching for hybrid models: shared full-attention KV pages plus GDN state checkpoints.

A prompt is cut into page-sized token blocks; block i is named by a hash chain, key_i = hash((key_{i-1}, block i's
token ids)), so a key names the whole prefix up to the end of its block. The cache keeps, per key, one full KV
page (it holds a reference on it, see KVPagePool.share) and, at some keys, a checkpoint: a copy of a GDN state
slot taken when a request's prefill stopped exactly at the end of that block. GDN state cannot be rebuilt from
KV, so a cached prefix is usable only up to a key that has a checkpoint: a new request takes a reference on
the pages of the longest such chain, copies the checkpoint into its own slot and computes only the rest. Its
first uncached token is at a page boundary, on a page of its own, so no request ever writes a shared page.

Which positions get checkpoints: the last page boundary of the prompt before its last token (a request always
computes and samples from at least one token) and, optionally, every `checkpoint_interval` pages; the scheduler
ends prefill chunks exactly there (`next_stop`). Copies are queued on the engine's stream right after the step
that reached the boundary, so stream order makes them exact under async scheduling.

Eviction is LRU over blocks only the cache holds (a page some request still uses frees nothing); evicting a
block drops its descendants too, since they can no longer be reached. Checkpoints live in their own small
StatePool and are evicted LRU when it is full. Every structure is guarded by one lock: a decode worker reserves
pages (which may evict) from other threads.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from deltamesh.engine.cache import KVPagePool, PoolExhausted, StatePool
from deltamesh.engine.request import Request


def block_key(parent: int | None, tokens) -> int:
    """The key of a token block after the prefix whose last block's key is `parent` (None: the first block). The
    router's cache-aware policy names what it sent each worker the same way."""
    return hash((parent, tuple(tokens)))


@dataclass
class _Block:
    parent: int | None  # the previous block's key; None for a prompt's first block
    tokens: tuple[int, ...]
    page: int
    depth: int
    last_use: int = 0
    children: set[int] = field(default_factory=set)
    checkpoint: int | None = None  # slot in the checkpoint pool


class PrefixCache:
    def __init__(
        self,
        kv_pool: KVPagePool,
        state_pool: StatePool,
        checkpoints: StatePool,
        stats,
        max_pages: int | None = None,
        checkpoint_interval: int | None = None,
    ):
        self.kv_pool, self.state_pool, self.checkpoints = kv_pool, state_pool, checkpoints
        self.stats = stats  # EngineStats: prefix_cache_hits, prefix_cache_hit_tokens, checkpoints_saved/_evicted
        self.max_pages = kv_pool.num_pages if max_pages is None else max_pages
        self.checkpoint_interval = checkpoint_interval
        self._blocks: dict[int, _Block] = {}
        self._checkpointed: OrderedDict[int, None] = OrderedDict()  # keys with a checkpoint, least recent first
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # ---- accounting ------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._blocks)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpointed)

    def reclaimable(self) -> int:
        """Pages that eviction can return to the pool: those only the cache holds."""
        with self._lock:
            return sum(self.kv_pool.refs(b.page) == 1 for b in self._blocks.values())

    # ---- positions ---------------------------------------------------------------------------------------
    def _last_boundary(self, req: Request) -> int:
        ps = self.kv_pool.page_size
        return (len(req.prompt_ids) - 1) // ps * ps

    def next_stop(self, req: Request) -> int | None:
        """The next token position at which the request's prefill must end a chunk (to checkpoint its state)."""
        last = self._last_boundary(req)
        if req.num_computed >= last:
            return None
        if self.checkpoint_interval:
            step = self.checkpoint_interval * self.kv_pool.page_size
            return min(last, (req.num_computed // step + 1) * step)
        return last

    def _is_checkpoint(self, req: Request, pos: int) -> bool:
        last = self._last_boundary(req)
        if pos <= 0 or pos > last:
            return False
        step = (self.checkpoint_interval or 0) * self.kv_pool.page_size
        return pos == last or (step > 0 and pos % step == 0)

    def _keys(self, req: Request, n: int) -> list[int]:
        """The chain keys of the request's first n prompt blocks (computed once per request)."""
        keys, ps = req.block_keys, self.kv_pool.page_size
        while len(keys) < n:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else None, req.prompt_ids[i * ps : (i + 1) * ps]))
        return keys[:n]

    def _block(self, req: Request, i: int) -> _Block | None:
        """The cached block i of the request's prompt, if the cache holds exactly those tokens after that prefix
        (a hash collision reads as a miss)."""
        keys, ps = req.block_keys, self.kv_pool.page_size
        b = self._blocks.get(keys[i])
        parent = keys[i - 1] if i else None
        if b is None or b.parent != parent or b.tokens != tuple(req.prompt_ids[i * ps : (i + 1) * ps]):
            return None
        return b

    def _touch(self, keys: list[int]) -> None:
        now = next(self._clock)
        for k in keys:
            if k in self._blocks:
                self._blocks[k].last_use = now

    # ---- admission -----------------------------------------------------------------------------------------
    def acquire(self, req: Request) -> list[int]:
        """The pages of the longest cached prefix of the prompt that ends at a checkpoint, with a reference
        taken on each (the caller frees them like any of its pages). Nothing else changes until `restore`."""
        n = self._last_boundary(req) // self.kv_pool.page_size
        with self._lock:
            keys = self._keys(req, n)
            best = 0
            for i in range(n):
                b = self._block(req, i)
                if b is None:
                    break
                if b.checkpoint is not None:
                    best = i + 1
            pages = [self._blocks[k].page for k in keys[:best]]
            self.kv_pool.share(pages)
            return pages

    def restore(self, req: Request, num_pages: int) -> None:
        """Start `req` (slot allocated, `num_pages` cached pages acquired) from the checkpoint at their end."""
        with self._lock:
            key = req.block_keys[num_pages - 1]
            src = self._blocks[key].checkpoint
            self.state_pool.copy_slot(req.slot, self.checkpoints, src)
            self._checkpointed.move_to_end(key)
            self._touch(req.block_keys[:num_pages][::-1])
        req.num_registered_pages = num_pages
        req.num_computed = num_pages * self.kv_pool.page_size
        self.stats.prefix_cache_hits += 1
        self.stats.prefix_cache_hit_tokens += req.num_computed

    # ---- allocation with eviction (any thread) ---------------------------------------------------------------
    def alloc(self, n: int, after: int | None = None) -> list[int]:
        """KV pages, evicting cached pages only the cache holds when the pool is short."""
        try:
            return self.kv_pool.alloc(n, after)
        except PoolExhausted:
            self.evict(n - self.kv_pool.num_free)
            return self.kv_pool.alloc(n, after)

    def evict(self, num_pages: int) -> None:
        """Free at least `num_pages` pages if that many are reclaimable (least recently used first)."""
        with self._lock:
            goal = self.kv_pool.num_free + num_pages
            for key in self._eviction_order(only_unshared=True):
                if self.kv_pool.num_free >= goal:
                    return
                if key in self._blocks:
                    self._drop(key)

    def _eviction_order(self, only_unshared: bool) -> list[int]:
        """Keys, those only the cache holds first, then least recently used first; among blocks used together,
        the deepest (the chain's tail) first."""
        order = []
        for k, b in self._blocks.items():
            shared = self.kv_pool.refs(b.page) > 1
            if not (only_unshared and shared):
                order.append(((shared, b.last_use, -b.depth), k))
        return [k for _, k in sorted(order)]

    def _drop(self, key: int, evicted: bool = True) -> None:
        b = self._blocks.pop(key)
        for child in list(b.children):
            self._drop(child, evicted)
        if b.parent is not None and b.parent in self._blocks:
            self._blocks[b.parent].children.discard(key)
        if b.checkpoint is not None:
            self._free_checkpoint(key, b)
            self.stats.checkpoints_evicted += evicted
        self.kv_pool.free([b.page])

    def clear(self) -> None:
        """Drop everything the cache holds."""
        with self._lock:
            for key in [k for k, b in self._blocks.items() if b.parent is None]:
                self._drop(key, evicted=False)

    # ---- filling (stepping thread, right after a prefill chunk is launched) ------------------------------------
    def register(self, req: Request) -> None:
        """Cache the request's newly computed full prompt pages, and checkpoint its state if its prefill
        has just stopped at a checkpoint position."""
        ps = self.kv_pool.page_size
        full = min(req.num_computed, len(req.prompt_ids)) // ps
        with self._lock:
            keys = self._keys(req, full)
            for i in range(req.num_registered_pages, full):
                if not self._insert(req, i):
                    break
            req.num_registered_pages = full
            pos = req.num_computed
            if self._is_checkpoint(req, pos) and self._block(req, pos // ps - 1) is not None:
                self._save_checkpoint(keys[pos // ps - 1], req.slot)
            self._touch(keys[::-1])

    def _insert(self, req: Request, i: int) -> bool:
        """Cache block i of the request's prompt (its page, unless the block is cached already). False when
        it cannot be: its parent is not cached, or the budget is spent on pages in use."""
        key, parent = req.block_keys[i], (req.block_keys[i - 1] if i else None)
        if key in self._blocks:
            return self._block(req, i) is not None
        if parent is not None and self._block(req, i - 1) is None:
            return False
        if len(self._blocks) >= self.max_pages:
            own = set(req.block_keys[:i])
            victims = [k for k in self._eviction_order(only_unshared=False) if k not in own]
            if not victims:
                return False
            self._drop(victims[0])
        ps = self.kv_pool.page_size
        page = req.pages[i]
        self.kv_pool.share([page])
        self._blocks[key] = _Block(parent, tuple(req.prompt_ids[i * ps : (i + 1) * ps]), page, i)
        if parent is not None:
            self._blocks[parent].children.add(key)
        return True

    def _save_checkpoint(self, key: int, slot: int) -> None:
        block = self._blocks[key]
        if block.checkpoint is not None:
            self._checkpointed.move_to_end(key)
            return
        if self.checkpoints.num_free == 0:
            oldest = next(iter(self._checkpointed))
            self._free_checkpoint(oldest, self._blocks[oldest])
            self.stats.checkpoints_evicted += 1
        dst = self.checkpoints.alloc(zeroed=False)
        self.checkpoints.copy_slot(dst, self.state_pool, slot)
        block.checkpoint = dst
        self._checkpointed[key] = None
        self.stats.checkpoints_saved += 1

    def _free_checkpoint(self, key: int, block: _Block) -> None:
        self.checkpoints.free(block.checkpoint)
        block.checkpoint = None
        del self._checkpointed[key]

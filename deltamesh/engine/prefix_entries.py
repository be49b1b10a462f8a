"""The prefix cache's entries and their eviction (prefix_cache.py looks prompts up in them and fills them).

An entry is a block (one full KV page of a prompt, named by its hash-chain key, maybe with a GDN checkpoint) or
a tail (a finished sequence's tokens past its last full page: a copy of their partial page and the state after
them). Every entry holds one KV page (a reference on it, see KVPagePool.share).

Eviction is LRU over blocks and tails. When the KV pool is short, only those the cache alone holds go (a page
some request still uses frees nothing); evicting a block drops its descendants and tails too, since they can no
longer be reached. The cache's own limits evict in the same order to make room before it inserts: at most
`max_pages` pages, and, under a memory budget, at most `max_bytes` of pages and checkpoints together
(`num_bytes`); here a shared entry may go too (the cache drops only its own reference). Every entry holds one
page, so the eviction order is sorted over page-indexed arrays (numpy), and each eviction frees 1/EVICTION_SLACK
of the cache's pages more than it needs: a full cache sorts once per that many insertions, not at each. A pinned
entry (`pin`: offered to another worker, which reads its pages and checkpoint in place) is never evicted, nor
are the blocks before it, until it is unpinned. Checkpoints live in their own StatePool and are evicted LRU when
it is full.

Not locked here: the prefix cache holds its lock around every call.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from deltamesh.engine.cache import KVPagePool, StatePool

TailKey = tuple[int | None, tuple[int, ...]]  # (key of the full block before it, its tokens)
EVICTION_SLACK = 64  # an eviction frees 1/EVICTION_SLACK of the cache's pages more than it needs
EVICTION_CHUNK = 1024  # entries in_rank_order sorts first
_DEPTH_BITS = 21


@dataclass
class Block:
    parent: int | None  # the previous block's key; None for a prompt's first block
    tokens: tuple[int, ...]
    page: int
    depth: int
    children: set[int] = field(default_factory=set)
    tails: set[TailKey] = field(default_factory=set)
    checkpoint: int | None = None  # slot in the checkpoint pool


@dataclass
class Tail:
    """The last tokens of a finished sequence past its last full page (fewer than a page)."""

    tokens: tuple[int, ...]
    page: int  # a copy of their partial page, the cache's own
    checkpoint: int  # slot in the checkpoint pool: the state after them
    depth: int  # full pages before it


def eviction_rank(shared: np.ndarray, last_use: np.ndarray, depth: np.ndarray, is_block: np.ndarray) -> np.ndarray:
    """One int64 per cache entry that orders as `np.lexsort((is_block, -depth, last_use, shared))`: unshared
    first, then least recently used, deepest, tails before blocks. Last uses are clock ticks (below 2**40);
    depths past 2**21 pages compare as equal."""
    most = (1 << _DEPTH_BITS) - 1
    rank = shared.astype(np.int64) << 62
    rank |= last_use.astype(np.int64) << (_DEPTH_BITS + 1)
    rank |= (most - np.minimum(depth, most).astype(np.int64)) << 1
    return rank | is_block.astype(np.int64)


def in_rank_order(items: np.ndarray, rank: np.ndarray, chunk: int = EVICTION_CHUNK):
    """`items` by ascending rank (ties in their given order), as a stable sort would give them, but sorting only a
    first chunk of the lowest ranks, and a twice larger one whenever the caller reads past it."""
    done = 0
    while done < len(items):
        k = min(len(items), max(2 * done, chunk))
        first = np.flatnonzero(rank <= np.partition(rank, k - 1)[k - 1])  # every rank up to the k-th, ties too
        first = first[np.argsort(rank[first], kind="stable")]
        yield from items[first[done:]].tolist()
        done = len(first)


class CacheEntries:
    def __init__(self, kv_pool: KVPagePool, checkpoints: StatePool, stats, max_pages: int, max_bytes: int | None):
        self.kv_pool, self.checkpoints = kv_pool, checkpoints
        self.stats = stats  # EngineStats: checkpoints_saved, checkpoints_evicted
        self.max_pages, self.max_bytes = max_pages, max_bytes
        self.blocks: dict[int, Block] = {}
        self.tails: dict[TailKey, Tail] = {}
        # per KV page the cache holds (each entry holds one): its entry's key, last use, depth, kind
        self._key_of: dict[int, int | TailKey] = {}
        self._last_use = np.zeros(kv_pool.num_pages + 1, dtype=np.int64)
        self._depth = np.zeros(kv_pool.num_pages + 1, dtype=np.int32)
        self._is_block = np.zeros(kv_pool.num_pages + 1, dtype=bool)
        self.slack = max_pages // EVICTION_SLACK
        # block keys with a checkpoint and tail keys, least recently used first
        self._checkpointed: OrderedDict[int | TailKey, None] = OrderedDict()
        self._clock = itertools.count(1)
        self._pinned: Counter = Counter()  # block and tail keys that eviction must leave (see `pin`)

    # ---- accounting ------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self.blocks) + len(self.tails)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpointed)

    @property
    def num_bytes(self) -> int:
        """What the memory budget counts: every page the cache holds (a page a running request shares is the
        cache's too once the request ends, so counting it keeps the bound true then) and every checkpoint."""
        return self.num_pages * self.kv_pool.page_bytes + self.num_checkpoints * self.checkpoints.slot_bytes

    def resume_keys(self) -> set[int]:
        """The block keys a request can resume after: blocks with a checkpoint, and the full blocks that tails
        follow (a tail of a sequence shorter than a page follows none)."""
        keys = (k if isinstance(k, int) else k[0] for k in self._checkpointed)
        return {k for k in keys if k is not None}

    # ---- use ---------------------------------------------------------------------------------------------------
    def touch(self, keys: list[int]) -> None:
        """Blocks used now (given deepest first: among entries used together, the deepest goes first)."""
        now = next(self._clock)
        for k in keys:
            if k in self.blocks:
                self._last_use[self.blocks[k].page] = now

    def touch_tail(self, key: TailKey, tail: Tail) -> None:
        self._last_use[tail.page] = next(self._clock)
        self._checkpointed.move_to_end(key)

    def touch_checkpoint(self, key: int | TailKey) -> None:
        self._checkpointed.move_to_end(key)

    def pin(self, keys: list) -> None:
        self._pinned.update(keys)

    def unpin(self, keys) -> None:
        self._pinned.subtract(keys)
        self._pinned = +self._pinned  # drop the keys no pin holds any more

    # ---- insertion (the caller has made room: `make_room`) ------------------------------------------------------
    def add_block(self, key: int, block: Block) -> None:
        """A block whose page the cache has taken a reference on."""
        self.blocks[key] = block
        self._hold(key, block.page, block.depth)
        if block.parent is not None:
            self.blocks[block.parent].children.add(key)

    def add_tail(self, key: TailKey, tail: Tail) -> None:
        """A tail whose page and checkpoint are the cache's own."""
        self.tails[key] = tail
        self._hold(key, tail.page, tail.depth)
        if key[0] is not None:
            self.blocks[key[0]].tails.add(key)
        self._checkpointed[key] = None
        self.stats.checkpoints_saved += 1

    def set_checkpoint(self, key: int, slot: int) -> None:
        """Block `key`'s checkpoint: `slot` of the checkpoint pool (`checkpoint_slot`)."""
        self.blocks[key].checkpoint = slot
        self._checkpointed[key] = None
        self.stats.checkpoints_saved += 1

    def _hold(self, key: int | TailKey, page: int, depth: int) -> None:
        self._key_of[page] = key
        self.kv_pool.note_cached(page, True)
        self._last_use[page] = next(self._clock)
        self._depth[page] = depth
        self._is_block[page] = isinstance(key, int)

    def make_room(self, own: list[int], pages: int = 1, checkpoints: int = 0) -> bool:
        """Room for `pages` more pages (blocks and tails both hold one) and `checkpoints` more checkpoints within
        the budgets, dropping the least recently used entries but the chain `own` being cached; False if only
        that chain is left."""
        if self._fits(pages, checkpoints):
            return True
        keep = set(own)
        for key in self.eviction_order(only_unshared=False):
            if key not in keep:
                self._drop(key)
                if self._fits(pages + self.slack, checkpoints):
                    return True
        return self._fits(pages, checkpoints)

    def _fits(self, pages: int, checkpoints: int) -> bool:
        more = pages * self.kv_pool.page_bytes + checkpoints * self.checkpoints.slot_bytes
        within_memory = self.max_bytes is None or self.num_bytes + more <= self.max_bytes
        return self.num_pages + pages <= self.max_pages and within_memory

    def checkpoint_slot(self) -> int | None:
        """A free checkpoint slot, evicting the least recently used checkpoint (or tail) when all are taken;
        None when every one is pinned."""
        if self.checkpoints.num_free == 0:
            oldest = next((k for k in self._checkpointed if k not in self._pinned), None)
            if oldest is None:
                return None
            if isinstance(oldest, int):
                self._free_checkpoint(oldest, self.blocks[oldest])
                self.stats.checkpoints_evicted += 1
            else:
                self._drop_tail(oldest, evicted=True)
        return self.checkpoints.alloc(zeroed=False)

    # ---- eviction ------------------------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> None:
        """Free at least `num_pages` pages if that many are reclaimable (least recently used first), and the
        slack more if there are."""
        goal = self.kv_pool.num_free + num_pages + self.slack
        for key in self.eviction_order(only_unshared=True):
            if self.kv_pool.num_free >= goal:
                return
            self._drop(key)

    def eviction_order(self, only_unshared: bool):
        """Block and tail keys, those only the cache holds first, then least recently used first; among entries
        used together, the deepest first (tails before their blocks). Pinned entries are left out. A generator:
        an entry dropped meanwhile (with an evicted parent) is skipped. An eviction mostly needs a few of a
        large cache's entries: only as many of the lowest ranks are sorted as are read (`in_rank_order`)."""
        pages = self.kv_pool.cached_pages
        if self._pinned:
            pinned = [p for p in map(self._page_of, self._pinned) if p is not None]
            pages = pages[~np.isin(pages, pinned)]
        shared = self.kv_pool.ref_counts[pages] > 1
        if only_unshared:
            pages, shared = pages[~shared], shared[~shared]
        rank = eviction_rank(shared, self._last_use[pages], self._depth[pages], self._is_block[pages])
        for page in in_rank_order(pages, rank):
            key = self._key_of.get(page)
            if key is not None:
                yield key

    def _page_of(self, key: int | TailKey) -> int | None:
        entry = self.blocks.get(key) if isinstance(key, int) else self.tails.get(key)
        return None if entry is None else entry.page

    def _drop(self, key: int | TailKey, evicted: bool = True) -> None:
        if not isinstance(key, int):
            self._drop_tail(key, evicted)
            return
        b = self.blocks.pop(key)
        for child in list(b.children):
            self._drop(child, evicted)
        for tail in list(b.tails):
            self._drop_tail(tail, evicted)
        if b.parent is not None and b.parent in self.blocks:
            self.blocks[b.parent].children.discard(key)
        if b.checkpoint is not None:
            self._free_checkpoint(key, b)
            self.stats.checkpoints_evicted += evicted
        del self._key_of[b.page]
        self.kv_pool.note_cached(b.page, False)
        self.kv_pool.free([b.page])

    def _drop_tail(self, key: TailKey, evicted: bool) -> None:
        tail = self.tails.pop(key)
        if key[0] in self.blocks:
            self.blocks[key[0]].tails.discard(key)
        self.checkpoints.free(tail.checkpoint)
        del self._checkpointed[key]
        self.stats.checkpoints_evicted += evicted
        del self._key_of[tail.page]
        self.kv_pool.note_cached(tail.page, False)
        self.kv_pool.free([tail.page])

    def _free_checkpoint(self, key: int, block: Block) -> None:
        assert block.checkpoint is not None, key
        self.checkpoints.free(block.checkpoint)
        block.checkpoint = None
        del self._checkpointed[key]

    def clear(self) -> None:
        """Drop every entry, pinned ones too (so only once nothing reads them)."""
        for key in [k for k, b in self.blocks.items() if b.parent is None]:
            self._drop(key, evicted=False)
        for tail_key in list(self.tails):
            self._drop_tail(tail_key, evicted=False)

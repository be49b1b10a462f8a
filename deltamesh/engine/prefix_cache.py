"""Exact prefix caching for hybrid models: shared full-attention KV pages plus GDN state checkpoints.

A prompt is cut into page-sized token blocks; block i is named by a hash chain, key_i = hash((key_{i-1}, block i's
token ids)), so a key names the whole prefix up to the end of its block. The cache keeps, per key, one full KV page
(it holds a reference on it, see KVPagePool.share) and, at some keys, a checkpoint: a copy of a GDN state slot
taken when a request's prefill stopped exactly at the end of that block, or passed it in a step that kept the state
there in a snapshot slot (ScheduledItem.snapshot_at, snapshot_slot). GDN state cannot be rebuilt from KV, so a cached prefix is
usable only up to a point that has a checkpoint: a new request takes a reference on the pages of the longest such
chain, copies the checkpoint into its own slot and computes only the rest.

A point inside a page is a tail: its tokens past the last full block, a copy of their partial page (the cache's
own) and the state after them. A request that starts from a tail copies that page into a page of its own and
goes on writing there, so no request ever writes a page the cache holds. A finished request leaves its whole
sequence (prompt and reply) this way, full pages and a tail, so that a conversation's next turn, whose prompt
repeats it, computes only its new message.

Which prompt positions get checkpoints, and where prefill chunks stop for them, is `positions`
(checkpoint_positions.py).

Eviction is LRU over blocks and tails. When the KV pool is short, only those the cache alone holds go (a page
some request still uses frees nothing); evicting a block drops its descendants and tails too, since they can no
longer be reached. The cache's own limits evict in the same order to make room before it inserts: at most
`max_pages` pages, and, under a memory budget, at most `max_bytes` of pages and checkpoints together
(`num_bytes`); here a shared entry may go too (the cache drops only its own reference). Every entry holds one
page, so the eviction order is sorted over page-indexed arrays (numpy), and each eviction frees 1/EVICTION_SLACK
of the cache's pages more than it needs: a full cache sorts once per that many insertions, not at each. A pinned
prefix (`pin`: offered to another worker, which reads its pages and checkpoint in place) is never evicted, nor
are the blocks before it, until it is unpinned. Checkpoints live in their own StatePool and are evicted LRU when
it is full. Every structure is guarded by one lock: a decode worker reserves pages (which may evict) from other
threads.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from deltamesh.engine.cache import KVPagePool, PoolExhausted, Region, StatePool
from deltamesh.engine.checkpoint_positions import CheckpointPositions
from deltamesh.engine.request import Request
from deltamesh.engine.sampling import SamplingParams


def block_key(parent: int | None, tokens) -> int:
    """The key of a token block after the prefix whose last block's key is `parent` (None: the first block). The
    router's cache-aware policy names what it sent each worker the same way."""
    return hash((parent, tuple(tokens)))


@dataclass
class _Tail:
    """The last tokens of a finished sequence past its last full page (fewer than a page)."""

    tokens: tuple[int, ...]
    page: int  # a copy of their partial page, the cache's own
    checkpoint: int  # slot in the checkpoint pool: the state after them
    depth: int  # full pages before it


TailKey = tuple[int | None, tuple[int, ...]]  # (key of the full block before it, its tokens)
EVICTION_SLACK = 64  # an eviction frees 1/EVICTION_SLACK of the cache's pages more than it needs
EVICTION_CHUNK = 1024  # entries _eviction_order sorts first
_DEPTH_BITS = 21


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


TURN_START = "<|im_start|>"  # the token that opens every message of the chat template (Qwen's)


@dataclass
class _Block:
    parent: int | None  # the previous block's key; None for a prompt's first block
    tokens: tuple[int, ...]
    page: int
    depth: int
    children: set[int] = field(default_factory=set)
    tails: set[TailKey] = field(default_factory=set)
    checkpoint: int | None = None  # slot in the checkpoint pool


@dataclass(frozen=True)
class PinnedPrefix:
    """A cached prefix kept from eviction while another worker reads it in place: its pages (the full blocks',
    then the tail's, a reference held on each) and the checkpoint of the state after its `num_tokens` tokens."""

    num_tokens: int
    pages: tuple[int, ...]
    checkpoint: int  # slot in the checkpoint pool
    entries: tuple  # the block and tail keys pinned


class PrefixCache:
    def __init__(
        self,
        kv_pool: KVPagePool,
        state_pool: StatePool,
        checkpoints: StatePool,
        stats,
        max_pages: int | None = None,
        checkpoint_interval: int | None = None,
        turn_start: int | None = None,
        max_bytes: int | None = None,
    ):
        """`turn_start`: the id of the token that opens each chat message (None: no turn checkpoints)."""
        self.kv_pool, self.state_pool, self.checkpoints = kv_pool, state_pool, checkpoints
        self.positions = CheckpointPositions(kv_pool.page_size, checkpoint_interval, turn_start)
        self.stats = stats  # EngineStats: prefix_cache_hits, prefix_cache_hit_tokens, checkpoints_saved/_evicted
        self.max_pages = kv_pool.num_pages if max_pages is None else max_pages
        self.max_bytes = max_bytes
        self._blocks: dict[int, _Block] = {}
        self._tails: dict[TailKey, _Tail] = {}
        # per KV page the cache holds (each entry holds one): its entry's key, last use, depth, kind
        self._key_of: dict[int, int | TailKey] = {}
        self._last_use = np.zeros(kv_pool.num_pages + 1, dtype=np.int64)
        self._depth = np.zeros(kv_pool.num_pages + 1, dtype=np.int32)
        self._is_block = np.zeros(kv_pool.num_pages + 1, dtype=bool)
        self._slack = self.max_pages // EVICTION_SLACK
        # block keys with a checkpoint and tail keys, least recently used first
        self._checkpointed: OrderedDict[int | TailKey, None] = OrderedDict()
        self._clock = itertools.count(1)
        self._pinned: Counter = Counter()  # block and tail keys that eviction must leave (see `pin`)
        self._lock = threading.RLock()

    # ---- accounting ------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._blocks) + len(self._tails)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpointed)

    @property
    def num_bytes(self) -> int:
        """What the memory budget counts: every page the cache holds (a page a running request shares is the
        cache's too once the request ends, so counting it keeps the bound true then) and every checkpoint."""
        return self.num_pages * self.kv_pool.page_bytes + self.num_checkpoints * self.checkpoints.slot_bytes

    def reclaimable(self) -> int:
        """Pages that eviction can return to the pool: those only the cache holds."""
        return self.kv_pool.num_cached_alone

    def _tokens(self, req: Request, i: int) -> tuple[int, ...]:
        ps = self.kv_pool.page_size
        return tuple(req.ids_between(i * ps, (i + 1) * ps))

    def _keys(self, req: Request, n: int) -> list[int]:
        """The chain keys of the request's first n blocks (prompt, then reply; computed once per request)."""
        keys = req.block_keys
        while len(keys) < n:
            keys.append(block_key(keys[-1] if keys else None, self._tokens(req, len(keys))))
        return keys[:n]

    def _block(self, req: Request, i: int) -> _Block | None:
        """The cached block i of the request's tokens, if the cache holds exactly those tokens after that prefix
        (a hash collision reads as a miss)."""
        keys = req.block_keys
        b = self._blocks.get(keys[i])
        parent = keys[i - 1] if i else None
        if b is None or b.parent != parent or b.tokens != self._tokens(req, i):
            return None
        return b

    def _tail(self, req: Request, depth: int, limit: int) -> _Tail | None:
        """The longest cached tail after the request's first `depth` full blocks that ends at or before
        token `limit`."""
        ps = self.kv_pool.page_size
        parent = req.block_keys[depth - 1] if depth else None
        ahead = req.ids_between(depth * ps, min(limit, (depth + 1) * ps - 1))
        for n in range(len(ahead), 0, -1):
            tail = self._tails.get((parent, tuple(ahead[:n])))
            if tail is not None:
                return tail
        return None

    def _touch(self, keys: list[int]) -> None:
        now = next(self._clock)
        for k in keys:
            if k in self._blocks:
                self._last_use[self._blocks[k].page] = now

    def _hold(self, key: int | TailKey, page: int, depth: int) -> None:
        self._key_of[page] = key
        self.kv_pool.note_cached(page, True)
        self._last_use[page] = next(self._clock)
        self._depth[page] = depth
        self._is_block[page] = isinstance(key, int)

    # ---- admission -----------------------------------------------------------------------------------------
    def acquire(self, req: Request) -> tuple[list[int], _Tail | None]:
        """The pages of the longest cached prefix of the prompt that ends at a checkpoint (a checkpointed
        block, or a tail after the blocks), with a reference taken on each page and on the tail's page (the
        caller frees the pages like any of its own, and hands the tail to `restore` or `release`). Nothing else
        changes until `restore`."""
        req.turn_end = self.positions.turn_end(req)
        with self._lock:
            best, tail = self._longest(req)
            pages = [self._blocks[k].page for k in req.block_keys[:best]]
            self.kv_pool.share(pages + ([tail.page] if tail else []))
            return pages, tail

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many tokens of this prompt a request would take from the cache now (any thread)."""
        return self.hit_tokens(Request("", prompt_ids, SamplingParams(), None))

    def hit_tokens(self, req: Request) -> int:
        """`cached_tokens` of a request's prompt; its block keys are computed once and kept on it (several ranks'
        caches ask, then the one it is admitted to)."""
        with self._lock:
            best, tail = self._longest(req)
        return best * self.kv_pool.page_size + (len(tail.tokens) if tail else 0)

    def _longest(self, req: Request) -> tuple[int, _Tail | None]:
        """(full blocks, tail after them) of the longest cached prefix of the prompt that ends at a checkpoint."""
        ps, limit = self.kv_pool.page_size, len(req.prompt_ids) - 1  # at least one prompt token is computed
        n = limit // ps
        keys = self._keys(req, n)
        best, best_tail = 0, self._tail(req, 0, limit)
        depth = 0
        while depth < n and self._block(req, depth) is not None:
            depth += 1
            if self._blocks[keys[depth - 1]].checkpoint is not None:
                best, best_tail = depth, None
            tail = self._tail(req, depth, limit)
            if tail is not None:
                best, best_tail = depth, tail
        return best, best_tail

    # ---- offering a prefix to another worker (any thread) -----------------------------------------------------
    def pin(self, prompt_ids: list[int]) -> PinnedPrefix | None:
        """The longest cached prefix of this prompt that ends at a checkpoint (as an admission would take it),
        kept from eviction until `unpin`; None when nothing is cached."""
        req = Request("", list(prompt_ids), SamplingParams(), None)
        with self._lock:
            best, tail = self._longest(req)
            if not best and tail is None:
                return None
            keys = req.block_keys[:best]
            pages = [self._blocks[k].page for k in keys]
            entries: list = list(keys)
            if tail is not None:
                pages.append(tail.page)
                entries.append((keys[-1] if keys else None, tail.tokens))
                checkpoint = tail.checkpoint
            else:
                checkpoint = self._blocks[keys[-1]].checkpoint
            self.kv_pool.share(pages)
            self._pinned.update(entries)
            self._touch(keys[::-1])
        num_tokens = best * self.kv_pool.page_size + (len(tail.tokens) if tail else 0)
        return PinnedPrefix(num_tokens, tuple(pages), checkpoint, tuple(entries))

    def regions(self, pinned: PinnedPrefix) -> list[Region]:
        """Where a pinned prefix's state is, in the order a reservation of its length is filled (core.py
        `reserve`): its pages, then the checkpoint (a slot the size of a state slot)."""
        return self.kv_pool.regions(list(pinned.pages)) + self.checkpoints.regions(pinned.checkpoint)

    def unpin(self, pinned: PinnedPrefix) -> None:
        with self._lock:
            self._pinned.subtract(pinned.entries)
            self._pinned = +self._pinned  # drop the keys no pin holds any more
            self.kv_pool.free(list(pinned.pages))

    def release(self, tail: _Tail | None) -> None:
        """Give back the reference `acquire` took on a tail that was not restored."""
        if tail is not None:
            self.kv_pool.free([tail.page])

    def restore(self, req: Request, num_pages: int, tail: _Tail | None = None) -> None:
        """Start `req` (slot and pages allocated, the first `num_pages` of them acquired) from the checkpoint
        at their end, or after `tail`, whose page is copied into the request's next page."""
        ps = self.kv_pool.page_size
        with self._lock:
            if tail is None:
                key = req.block_keys[num_pages - 1]
                src = self._blocks[key].checkpoint
            else:
                key, src = (req.block_keys[num_pages - 1] if num_pages else None, tail.tokens), tail.checkpoint
                self.kv_pool.copy_page(req.pages[num_pages], tail.page)
                self._last_use[tail.page] = next(self._clock)
            self.state_pool.copy_slot(req.slot, self.checkpoints, src)
            self._checkpointed.move_to_end(key)
            self._touch(req.block_keys[:num_pages][::-1])
        self.release(tail)
        req.num_registered_pages = num_pages
        req.num_computed = num_pages * ps + (len(tail.tokens) if tail else 0)
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
        """Free at least `num_pages` pages if that many are reclaimable (least recently used first), and the
        slack more if there are."""
        with self._lock:
            goal = self.kv_pool.num_free + num_pages + self._slack
            for key in self._eviction_order(only_unshared=True):
                if self.kv_pool.num_free >= goal:
                    return
                self._drop(key)

    def _eviction_order(self, only_unshared: bool):
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
        entry = self._blocks.get(key) if isinstance(key, int) else self._tails.get(key)
        return None if entry is None else entry.page

    def _drop(self, key: int | TailKey, evicted: bool = True) -> None:
        if not isinstance(key, int):
            self._drop_tail(key, evicted)
            return
        b = self._blocks.pop(key)
        for child in list(b.children):
            self._drop(child, evicted)
        for tail in list(b.tails):
            self._drop_tail(tail, evicted)
        if b.parent is not None and b.parent in self._blocks:
            self._blocks[b.parent].children.discard(key)
        if b.checkpoint is not None:
            self._free_checkpoint(key, b)
            self.stats.checkpoints_evicted += evicted
        del self._key_of[b.page]
        self.kv_pool.note_cached(b.page, False)
        self.kv_pool.free([b.page])

    def _drop_tail(self, key: TailKey, evicted: bool) -> None:
        tail = self._tails.pop(key)
        if key[0] in self._blocks:
            self._blocks[key[0]].tails.discard(key)
        self.checkpoints.free(tail.checkpoint)
        del self._checkpointed[key]
        self.stats.checkpoints_evicted += evicted
        del self._key_of[tail.page]
        self.kv_pool.note_cached(tail.page, False)
        self.kv_pool.free([tail.page])

    def clear(self) -> None:
        """Drop everything the cache holds, pinned prefixes too (so only once nothing reads them)."""
        with self._lock:
            for key in [k for k, b in self._blocks.items() if b.parent is None]:
                self._drop(key, evicted=False)
            for key in list(self._tails):
                self._drop_tail(key, evicted=False)

    # ---- filling (stepping thread, right after a prefill chunk is launched) ------------------------------------
    def register(self, req: Request, snapshot_at: int | None = None, snapshot_slot: int | None = None) -> None:
        """Cache the request's newly computed full prompt pages, and checkpoint its state if its prefill has just
        stopped at a checkpoint position, or passed `snapshot_at`, whose state the step left in `snapshot_slot`."""
        pos = req.num_computed
        with self._lock:
            keys = self._insert_pages(req, min(pos, len(req.prompt_ids)) // self.kv_pool.page_size)
            if keys is None:
                return
            if snapshot_at is not None:
                self._save_state(req, snapshot_at, keys, snapshot_slot)
            elif self.positions.is_checkpoint(req, pos):
                self._save_state(req, pos, keys)

    def register_finished(self, req: Request) -> None:
        """Cache a finished request's whole computed sequence (stepping thread, before its pages and slot are
        freed): its full pages, and the state after them (a tail of the tokens past the last one)."""
        end = min(req.num_computed, len(req.prompt_ids) + len(req.output_ids))  # the state holds these tokens
        if req.slot is None or end <= 0:
            return
        with self._lock:
            keys = self._insert_pages(req, end // self.kv_pool.page_size)
            if keys is not None:
                self._save_state(req, end, keys)

    def _insert_pages(self, req: Request, full: int) -> list[int] | None:
        """Cache the request's first `full` pages (those not offered yet); their keys, or None when the chain
        breaks (the budget is spent on pages in use)."""
        keys = self._keys(req, full)
        for i in range(req.num_registered_pages, full):
            if not self._insert(req, i):
                req.num_registered_pages = i
                return None
        req.num_registered_pages = full
        self._touch(keys[::-1])
        return keys

    def _save_state(self, req: Request, pos: int, keys: list[int], src: int | None = None) -> None:
        """Keep the request's state after its first `pos` tokens (`keys`: its full blocks, at least up to there),
        read from state slot `src` (default: the request's own): a checkpoint on the block ending there, or a
        tail past the last full block."""
        full = pos // self.kv_pool.page_size
        src = req.slot if src is None else src
        if pos == full * self.kv_pool.page_size:
            self._save_checkpoint(keys[full - 1], src, keys[:full])
        else:
            tokens = tuple(req.ids_between(full * self.kv_pool.page_size, pos))
            self._save_tail((keys[full - 1] if full else None, tokens), req, full, src)

    def _save_tail(self, key: TailKey, req: Request, depth: int, src: int) -> None:
        if key in self._tails:
            self._last_use[self._tails[key].page] = next(self._clock)
            self._checkpointed.move_to_end(key)
            return
        if not self._make_room(req.block_keys[:depth], checkpoints=1):
            return
        try:
            [page] = self.kv_pool.alloc(1)
        except PoolExhausted:
            return
        if key[0] is not None and key[0] not in self._blocks:  # the budget's eviction took its parent
            self.kv_pool.free([page])
            return
        slot = self._checkpoint_slot()
        if slot is None:
            self.kv_pool.free([page])
            return
        self.kv_pool.copy_page(page, req.pages[depth])
        self.checkpoints.copy_slot(slot, self.state_pool, src)
        self._tails[key] = _Tail(key[1], page, slot, depth)
        self._hold(key, page, depth)
        if key[0] is not None:
            self._blocks[key[0]].tails.add(key)
        self._checkpointed[key] = None
        self.stats.checkpoints_saved += 1

    def _insert(self, req: Request, i: int) -> bool:
        """Cache block i of the request's tokens (its page, unless the block is cached already). False when
        it cannot be: its parent is not cached, or the budget is spent on pages in use."""
        key, parent = req.block_keys[i], (req.block_keys[i - 1] if i else None)
        if key in self._blocks:
            return self._block(req, i) is not None
        if parent is not None and self._block(req, i - 1) is None:
            return False
        if not self._make_room(req.block_keys[:i]):
            return False
        page = req.pages[i]
        self.kv_pool.share([page])
        self._blocks[key] = _Block(parent, self._tokens(req, i), page, i)
        self._hold(key, page, i)
        if parent is not None:
            self._blocks[parent].children.add(key)
        return True

    def _make_room(self, own: list[int], pages: int = 1, checkpoints: int = 0) -> bool:
        """Room for `pages` more pages (blocks and tails both hold one) and `checkpoints` more checkpoints within
        the budgets, dropping the least recently used entries but the chain `own` being cached; False if only
        that chain is left."""
        if self._fits(pages, checkpoints):
            return True
        keep = set(own)
        for key in self._eviction_order(only_unshared=False):
            if key not in keep:
                self._drop(key)
                if self._fits(pages + self._slack, checkpoints):
                    return True
        return self._fits(pages, checkpoints)

    def _fits(self, pages: int, checkpoints: int) -> bool:
        more = pages * self.kv_pool.page_bytes + checkpoints * self.checkpoints.slot_bytes
        within_memory = self.max_bytes is None or self.num_bytes + more <= self.max_bytes
        return self.num_pages + pages <= self.max_pages and within_memory

    def _save_checkpoint(self, key: int, slot: int, own: list[int]) -> None:
        block = self._blocks[key]
        if block.checkpoint is not None:
            self._checkpointed.move_to_end(key)
            return
        if not self._make_room(own, pages=0, checkpoints=1):
            return
        dst = self._checkpoint_slot()
        if dst is None:
            return
        self.checkpoints.copy_slot(dst, self.state_pool, slot)
        block.checkpoint = dst
        self._checkpointed[key] = None
        self.stats.checkpoints_saved += 1

    def _checkpoint_slot(self) -> int | None:
        """A free checkpoint slot, evicting the least recently used checkpoint (or tail) when all are taken;
        None when every one is pinned."""
        if self.checkpoints.num_free == 0:
            oldest = next((k for k in self._checkpointed if k not in self._pinned), None)
            if oldest is None:
                return None
            if isinstance(oldest, int):
                self._free_checkpoint(oldest, self._blocks[oldest])
                self.stats.checkpoints_evicted += 1
            else:
                self._drop_tail(oldest, evicted=True)
        return self.checkpoints.alloc(zeroed=False)

    def _free_checkpoint(self, key: int, block: _Block) -> None:
        self.checkpoints.free(block.checkpoint)
        block.checkpoint = None
        del self._checkpointed[key]

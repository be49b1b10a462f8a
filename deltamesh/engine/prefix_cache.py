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

Its entries (blocks and tails, their checkpoints) and their LRU eviction under the cache's limits are
prefix_entries.py's. Every structure is guarded by one lock: a decode worker reserves pages (which may evict)
from other threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from deltamesh.engine.cache import KVPagePool, PoolExhausted, Region, StatePool
from deltamesh.engine.checkpoint_positions import CheckpointPositions
from deltamesh.engine.interfaces import PrefixCacheInterface
from deltamesh.engine.prefix_entries import Block, CacheEntries, Tail, TailKey
from deltamesh.engine.request import Request
from deltamesh.protocol.blocks import block_key
from deltamesh.protocol.sampling import SamplingParams

TURN_START = "<|im_start|>"  # the token that opens every message of the chat template (Qwen's)


@dataclass(frozen=True)
class PinnedPrefix:
    """A cached prefix kept from eviction while another worker reads it in place: its pages (the full blocks',
    then the tail's, a reference held on each) and the checkpoint of the state after its `num_tokens` tokens."""

    num_tokens: int
    pages: tuple[int, ...]
    checkpoint: int  # slot in the checkpoint pool
    entries: tuple  # the block and tail keys pinned


class PrefixCache(PrefixCacheInterface):
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
        self.stats = stats  # EngineStats: prefix_cache_hits, prefix_cache_hit_tokens
        max_pages = kv_pool.num_pages if max_pages is None else max_pages
        self.entries = CacheEntries(kv_pool, checkpoints, stats, max_pages, max_bytes)
        self._lock = threading.RLock()

    # ---- accounting ------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.entries.num_pages

    @property
    def num_checkpoints(self) -> int:
        return self.entries.num_checkpoints

    @property
    def num_bytes(self) -> int:
        return self.entries.num_bytes

    def reclaimable(self) -> int:
        """Pages that eviction can return to the pool: those only the cache holds."""
        return self.kv_pool.num_cached_alone

    def resume_keys(self) -> set[int]:
        with self._lock:
            return self.entries.resume_keys()

    def _tokens(self, req: Request, i: int) -> tuple[int, ...]:
        ps = self.kv_pool.page_size
        return tuple(req.ids_between(i * ps, (i + 1) * ps))

    def _keys(self, req: Request, n: int) -> list[int]:
        """The chain keys of the request's first n blocks (prompt, then reply; computed once per request)."""
        keys = req.block_keys
        while len(keys) < n:
            keys.append(block_key(keys[-1] if keys else None, self._tokens(req, len(keys))))
        return keys[:n]

    def _block(self, req: Request, i: int) -> Block | None:
        """The cached block i of the request's tokens, if the cache holds exactly those tokens after that prefix
        (a hash collision reads as a miss)."""
        keys = req.block_keys
        b = self.entries.blocks.get(keys[i])
        parent = keys[i - 1] if i else None
        if b is None or b.parent != parent or b.tokens != self._tokens(req, i):
            return None
        return b

    def _tail(self, req: Request, depth: int, limit: int) -> Tail | None:
        """The longest cached tail after the request's first `depth` full blocks that ends at or before
        token `limit`."""
        ps = self.kv_pool.page_size
        parent = req.block_keys[depth - 1] if depth else None
        ahead = req.ids_between(depth * ps, min(limit, (depth + 1) * ps - 1))
        for n in range(len(ahead), 0, -1):
            tail = self.entries.tails.get((parent, tuple(ahead[:n])))
            if tail is not None:
                return tail
        return None

    # ---- admission -----------------------------------------------------------------------------------------
    def acquire(self, req: Request) -> tuple[list[int], Tail | None]:
        """The pages of the longest cached prefix of the prompt that ends at a checkpoint (a checkpointed
        block, or a tail after the blocks), with a reference taken on each page and on the tail's page (the
        caller frees the pages like any of its own, and hands the tail to `restore` or `release`). Nothing else
        changes until `restore`. None for a request that asks for its prompt's logprobs."""
        req.turn_end = self.positions.turn_end(req)
        if req.params.prompt_logprobs is not None:  # a cached prefix's positions have no logits to give
            return [], None
        with self._lock:
            best, tail = self._longest(req)
            pages = [self.entries.blocks[k].page for k in req.block_keys[:best]]
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

    def _longest(self, req: Request) -> tuple[int, Tail | None]:
        """(full blocks, tail after them) of the longest cached prefix of the prompt that ends at a checkpoint."""
        ps, limit = self.kv_pool.page_size, len(req.prompt_ids) - 1  # at least one prompt token is computed
        n = limit // ps
        keys = self._keys(req, n)
        best, best_tail = 0, self._tail(req, 0, limit)
        depth = 0
        while depth < n and self._block(req, depth) is not None:
            depth += 1
            if self.entries.blocks[keys[depth - 1]].checkpoint is not None:
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
            pages = [self.entries.blocks[k].page for k in keys]
            entries: list = list(keys)
            checkpoint: int | None
            if tail is not None:
                pages.append(tail.page)
                entries.append((keys[-1] if keys else None, tail.tokens))
                checkpoint = tail.checkpoint
            else:
                checkpoint = self.entries.blocks[keys[-1]].checkpoint
            assert checkpoint is not None, "the longest prefix ends at a checkpoint"
            self.kv_pool.share(pages)
            self.entries.pin(entries)
            self.entries.touch(keys[::-1])
        num_tokens = best * self.kv_pool.page_size + (len(tail.tokens) if tail else 0)
        return PinnedPrefix(num_tokens, tuple(pages), checkpoint, tuple(entries))

    def regions(self, pinned: PinnedPrefix) -> list[Region]:
        """Where a pinned prefix's state is, in the order a reservation of its length is filled
        (reservations.py): its pages, then the checkpoint (a slot the size of a state slot)."""
        return self.kv_pool.regions(list(pinned.pages)) + self.checkpoints.regions(pinned.checkpoint)

    def unpin(self, pinned: PinnedPrefix) -> None:
        with self._lock:
            self.entries.unpin(pinned.entries)
            self.kv_pool.free(list(pinned.pages))

    def release(self, tail: Tail | None) -> None:
        """Give back the reference `acquire` took on a tail that was not restored."""
        if tail is not None:
            self.kv_pool.free([tail.page])

    def restore(self, req: Request, num_pages: int, tail: Tail | None = None) -> None:
        """Start `req` (slot and pages allocated, the first `num_pages` of them acquired) from the checkpoint
        at their end, or after `tail`, whose page is copied into the request's next page."""
        ps = self.kv_pool.page_size
        with self._lock:
            if tail is None:
                key = req.block_keys[num_pages - 1]
                checkpoint = self.entries.blocks[key].checkpoint
                assert checkpoint is not None, "a request resumes at a block's checkpoint"
                self.state_pool.copy_slot(req.held_slot, self.checkpoints, checkpoint)
                self.entries.touch_checkpoint(key)
            else:
                self.kv_pool.copy_page(req.pages[num_pages], tail.page)
                self.state_pool.copy_slot(req.held_slot, self.checkpoints, tail.checkpoint)
                self.entries.touch_tail((req.block_keys[num_pages - 1] if num_pages else None, tail.tokens), tail)
            self.entries.touch(req.block_keys[:num_pages][::-1])
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
            with self._lock:
                self.entries.evict(n - self.kv_pool.num_free)
            return self.kv_pool.alloc(n, after)

    def clear(self) -> None:
        """Drop everything the cache holds, pinned prefixes too (so only once nothing reads them)."""
        with self._lock:
            self.entries.clear()

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
        self.entries.touch(keys[::-1])
        return keys

    def _insert(self, req: Request, i: int) -> bool:
        """Cache block i of the request's tokens (its page, unless the block is cached already). False when
        it cannot be: its parent is not cached, or the budget is spent on pages in use."""
        key, parent = req.block_keys[i], (req.block_keys[i - 1] if i else None)
        if key in self.entries.blocks:
            return self._block(req, i) is not None
        if parent is not None and self._block(req, i - 1) is None:
            return False
        if not self.entries.make_room(req.block_keys[:i]):
            return False
        page = req.pages[i]
        self.kv_pool.share([page])
        self.entries.add_block(key, Block(parent, self._tokens(req, i), page, i))
        return True

    def _save_state(self, req: Request, pos: int, keys: list[int], src: int | None = None) -> None:
        """Keep the request's state after its first `pos` tokens (`keys`: its full blocks, at least up to there),
        read from state slot `src` (default: the request's own): a checkpoint on the block ending there, or a
        tail past the last full block."""
        full = pos // self.kv_pool.page_size
        src = req.held_slot if src is None else src
        if pos == full * self.kv_pool.page_size:
            self._save_checkpoint(keys[full - 1], src, keys[:full])
        else:
            tokens = tuple(req.ids_between(full * self.kv_pool.page_size, pos))
            self._save_tail((keys[full - 1] if full else None, tokens), req, full, src)

    def _save_tail(self, key: TailKey, req: Request, depth: int, src: int) -> None:
        entries = self.entries
        if key in entries.tails:
            entries.touch_tail(key, entries.tails[key])
            return
        if not entries.make_room(req.block_keys[:depth], checkpoints=1):
            return
        try:
            [page] = self.kv_pool.alloc(1)
        except PoolExhausted:
            return
        if key[0] is not None and key[0] not in entries.blocks:  # the budget's eviction took its parent
            self.kv_pool.free([page])
            return
        slot = entries.checkpoint_slot()
        if slot is None:
            self.kv_pool.free([page])
            return
        self.kv_pool.copy_page(page, req.pages[depth])
        self.checkpoints.copy_slot(slot, self.state_pool, src)
        entries.add_tail(key, Tail(key[1], page, slot, depth))

    def _save_checkpoint(self, key: int, slot: int, own: list[int]) -> None:
        entries = self.entries
        if entries.blocks[key].checkpoint is not None:
            entries.touch_checkpoint(key)
            return
        if not entries.make_room(own, pages=0, checkpoints=1):
            return
        dst = entries.checkpoint_slot()
        if dst is None:
            return
        self.checkpoints.copy_slot(dst, self.state_pool, slot)
        entries.set_checkpoint(key, dst)

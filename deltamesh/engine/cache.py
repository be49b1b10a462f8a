"""Per-request state pools, allocated once.

- `KVPagePool`: the KV cache of every full-attention layer, page-major
  ([page, layer, k|v, page_size, kv_heads, head_dim]): one page holds all layers' keys and values for
  `page_size` tokens, so a request's KV is as many contiguous regions as its pages form runs. Pages are
  handed out best-fit as whole runs, so a freshly admitted request usually owns one run. Page 0 is never
  handed out: it is the scratch page that padded rows of a batch (CUDA graphs) write to.
- `StatePool`: GDN conv + recurrent state, slot-major ([slot, layer, ...]): one request's state is two
  contiguous regions whatever the number of layers. Kernels address a layer's states as the flattened
  pool [slot * layers + layer], so they read and write in place. Slot 0 is never handed out: it is the
  scratch slot that padded rows of a batch (CUDA graphs) read and write.

KV pages are reference-counted: the prefix cache (prefix_cache.py) shares a full page between the requests whose
prompts begin with the same tokens, and a page returns to the free set when its last holder frees it.

Both pools count what is in use, so tests can prove that nothing leaks.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np
import torch


class PoolExhausted(RuntimeError):
    """Not enough free pages or slots right now."""


@dataclass(frozen=True)
class Region:
    """A contiguous byte range of a pool tensor: what the transfer layer moves."""

    tensor: torch.Tensor  # 1-D uint8 view
    name: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()


@dataclass(frozen=True)
class RankBytes:
    """Bytes of another rank's pools (a follower process of a parallel engine): `nbytes` at `address` in that
    process. A held state stays there, and the transport reads it there."""

    rank: int
    address: int
    nbytes: int


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pool_views(kv: KVPagePool, states: StatePool) -> list[torch.Tensor]:
    """Each pool's whole memory as a 1-D byte view: what a prefill worker lets peers read."""
    return [byte_view(t) for t in (kv.data, states.conv, states.recurrent)]


class KVPagePool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_pages, self.page_size, self.num_layers = num_pages, page_size, num_layers
        shape = (num_pages + 1, max(num_layers, 1), 2, page_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self._free = np.ones(num_pages + 1, dtype=bool)
        self._free[0] = False  # the scratch page
        self._runs = FreeRuns(1, num_pages)  # the same free pages as runs: finding room never scans the pool
        self._refs = np.zeros(num_pages + 1, dtype=np.int32)  # holders of each page (requests, the prefix cache)
        self._num_free = num_pages  # kept with _free: the prefix cache asks after every page it evicts
        self._cached = np.zeros(num_pages + 1, dtype=bool)  # pages the prefix cache holds (note_cached)
        self._num_cached_alone = 0  # of those, the ones no request holds too: what eviction could free
        self._lock = threading.Lock()
        self.mirror: list | None = None  # tensor parallelism: writes outside model steps, as StatePool.mirror

    @classmethod
    def shaped_like(cls, pool: KVPagePool, num_pages: int | None = None, device=None) -> KVPagePool:
        """A new pool of `pool`'s page shape and dtype (its page count and device unless given)."""
        d = pool.data
        return cls(
            pool.num_pages if num_pages is None else num_pages,
            pool.page_size,
            pool.num_layers,
            d.shape[4],
            d.shape[5],
            d.dtype,
            d.device if device is None else device,
        )

    # -- views -------------------------------------------------------------------------------------
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of full-attention layer i, each [num_pages, page_size, H, D] (strided)."""
        return self.data[:, i, 0], self.data[:, i, 1]

    @property
    def page_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def copy_page(self, dst: int, src: int) -> None:
        """Page `dst` := page `src`, every layer (queued on the current stream)."""
        self.data[dst].copy_(self.data[src], non_blocking=True)
        if self.mirror is not None:
            self.mirror.append(("copy_page", "kv", dst, src))

    def regions(self, pages: list[int]) -> list[Region]:
        flat = self.data.flatten(1)
        return [Region(byte_view(flat[s : s + n]), f"kv[{s}:{s + n}]") for s, n in page_runs(pages)]

    # -- accounting --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def ref_counts(self) -> np.ndarray:
        """Holders of every page (index 0: the scratch page), read-only: the prefix cache orders its eviction
        and counts what it could free from it without a call per page."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    @property
    def cached_pages(self) -> np.ndarray:
        """The pages the prefix cache holds (note_cached), ascending."""
        return np.flatnonzero(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached_alone(self) -> int:
        """Pages the prefix cache holds and nothing else does (kept as references change: admission asks for it
        whenever the pool is short)."""
        return self._num_cached_alone

    def note_cached(self, page: int, cached: bool) -> None:
        """The prefix cache takes a page it holds a reference on (True), or is about to free its reference
        (False)."""
        with self._lock:
            if self._cached[page] != cached:
                self._cached[page] = cached
                self._num_cached_alone += (1 if cached else -1) * int(self._refs[page] == 1)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int, after: int | None = None) -> list[int]:
        """n pages, as few runs as possible; `after` asks for the pages following an existing page."""
        if n <= 0:
            return []
        with self._lock:
            if n > self._num_free:
                raise PoolExhausted(f"need {n} KV pages, {self._num_free} free")
            if after is not None and self._runs.length_at(after + 1) >= n:  # `after` is taken: a run starts there
                pages = self._runs.take(after + 1, n)
            else:
                pages = self._runs.best_fit(n)
            self._free[pages] = False
            self._refs[pages] = 1
            self._num_free -= n
            return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these (allocated) pages; each holder frees them once."""
        if not pages:
            return
        with self._lock:
            unique = np.unique(pages)  # each page once, as numpy's indexed updates count it
            if self._free[unique].any():
                raise RuntimeError(f"sharing free KV pages {unique[self._free[unique]].tolist()}")
            self._num_cached_alone -= int(np.count_nonzero(self._cached[unique] & (self._refs[unique] == 1)))
            self._refs[unique] += 1

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        with self._lock:
            unique = np.unique(pages)
            if self._free[unique].any():
                raise RuntimeError(f"double free of KV unique {unique[self._free[unique]].tolist()}")
            refs = self._refs[unique] - 1
            cached = self._cached[unique]
            if (cached & (refs == 0)).any():  # the cache says note_cached(page, False) before it lets a page go
                raise RuntimeError(
                    f"KV unique the prefix cache holds freed by their last holder: "
                    f"{unique[cached & (refs == 0)].tolist()}"
                )
            self._refs[unique] = refs
            self._num_cached_alone += int(np.count_nonzero(cached & (refs == 1)))
            freed = refs == 0
            self._free[unique] = freed
            back = unique[freed]
            self._num_free += len(back)
            self._runs.give_back(back.tolist())


class StatePool:
    SCRATCH = 0  # the slot that padded rows of a batch use, never handed out; also a step's first state snapshot

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        conv_dim: int,
        conv_width: int,
        num_v_heads: int,
        key_dim: int,
        value_dim: int,
        conv_dtype: torch.dtype,
        state_dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots, self.num_layers = num_slots, max(num_layers, 1)
        self.conv = torch.zeros(
            (num_slots + 1, self.num_layers, conv_dim, conv_width - 1), dtype=conv_dtype, device=device
        )
        self.recurrent = torch.zeros(
            (num_slots + 1, self.num_layers, num_v_heads, value_dim, key_dim), dtype=state_dtype, device=device
        )
        self._free = list(range(num_slots, 0, -1))  # all but the scratch slot
        self._lock = threading.Lock()
        # Tensor parallelism: the leader records its writes outside model steps here (name, then the op), for
        # the other ranks to repeat on their own pools before their next step (engine/tp_workers.py).
        self.name = ""
        self.mirror: list | None = None

    @classmethod
    def shaped_like(cls, pool: StatePool, num_slots: int | None = None, device=None) -> StatePool:
        """A new pool of `pool`'s slot shape and dtypes (its slot count and device unless given), unnamed."""
        c, r = pool.conv, pool.recurrent
        return cls(
            pool.num_slots if num_slots is None else num_slots,
            pool.num_layers,
            c.shape[2],
            c.shape[3] + 1,
            r.shape[2],
            r.shape[4],
            r.shape[3],
            c.dtype,
            r.dtype,
            c.device if device is None else device,
        )

    @property
    def conv_flat(self) -> torch.Tensor:
        """[slots * layers, C, W-1]: layer i of slot s is row `s * num_layers + i`."""
        return self.conv.flatten(0, 1)

    @property
    def recurrent_flat(self) -> torch.Tensor:
        """[slots * layers, HV, V, K]: layer i of slot s is row `s * num_layers + i`."""
        return self.recurrent.flatten(0, 1)

    def layer_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, B]: row i holds the flat-pool rows of layer i for `slots` (computed once per step). Each row
        starts 16-byte aligned, as FlashInfer requires of its index tensors."""
        b = slots.shape[0]
        padded = -(-b * slots.element_size() // 16) * 16 // slots.element_size()
        layers = torch.arange(self.num_layers, dtype=slots.dtype, device=slots.device)
        rows = torch.empty((self.num_layers, padded), dtype=slots.dtype, device=slots.device)
        torch.add(slots[None, :] * self.num_layers, layers[:, None], out=rows[:, :b])
        return rows[:, :b]

    def regions(self, slot: int) -> list[Region]:
        return [
            Region(byte_view(self.conv[slot]), f"conv[{slot}]"),
            Region(byte_view(self.recurrent[slot]), f"recurrent[{slot}]"),
        ]

    @property
    def slot_bytes(self) -> int:
        return (
            self.conv[0].numel() * self.conv.element_size() + self.recurrent[0].numel() * self.recurrent.element_size()
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, zeroed: bool = True) -> int:
        """A slot, zeroed (a new request starts from the empty state) unless the caller overwrites all of it."""
        with self._lock:
            if not self._free:
                raise PoolExhausted(f"all {self.num_slots} GDN state slots are in use")
            slot = self._free.pop()
        if zeroed:
            self.zero(slot)
        return slot

    def zero(self, slot: int) -> None:
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()
        if self.mirror is not None:
            self.mirror.append(("zero", self.name, slot))

    def copy_slot(self, dst: int, src_pool: StatePool, src: int) -> None:
        """Slot `dst` of this pool := slot `src` of `src_pool` (queued on the current stream)."""
        self.conv[dst].copy_(src_pool.conv[src], non_blocking=True)
        self.recurrent[dst].copy_(src_pool.recurrent[src], non_blocking=True)
        if self.mirror is not None:
            self.mirror.append(("copy", self.name, dst, src_pool.name, src))

    def free(self, slot: int) -> None:
        with self._lock:
            if slot in self._free:
                raise RuntimeError(f"double free of GDN state slot {slot}")
            self._free.append(slot)


class FreeRuns:
    """A pool's free pages as maximal runs of consecutive ids, kept as pages are taken and given back, so that
    finding room costs as much as the runs it touches, not a pass over the whole pool (a GPU's pool holds
    hundreds of thousands of pages). Pages are always taken from the start of a run."""

    def __init__(self, first: int, count: int):
        self._length_at: dict[int, int] = {}  # run start -> its length
        self._start_ending_at: dict[int, int] = {}  # run end (exclusive) -> its start
        self._starts_of: dict[int, set[int]] = {}  # length -> the starts of the runs that long
        self._lengths: list[int] = []  # the lengths present, ascending
        if count:
            self._add(first, count)

    def length_at(self, start: int) -> int:
        """The length of the free run starting at `start` (0: none does)."""
        return self._length_at.get(start, 0)

    def take(self, start: int, n: int) -> list[int]:
        """The first n pages of the run starting at `start`."""
        length = self._remove(start)
        if length > n:
            self._add(start + n, length - n)
        return list(range(start, start + n))

    def best_fit(self, n: int) -> list[int]:
        """n pages: the shortest run that holds them all, else the longest runs first (ascending ids); the caller
        knows that n pages are free."""
        i = bisect.bisect_left(self._lengths, n)
        if i < len(self._lengths):
            return self.take(self._any_start(self._lengths[i]), n)
        pages: list[int] = []
        while len(pages) < n:
            length = self._lengths[-1]
            pages += self.take(self._any_start(length), min(length, n - len(pages)))
        return sorted(pages)

    def give_back(self, pages: list[int]) -> None:
        """Pages (ascending, each free again) rejoin the runs beside them."""
        for start, count in page_runs(pages):
            end = start + count
            if end in self._length_at:
                count += self._remove(end)
            if start in self._start_ending_at:
                left = self._start_ending_at[start]
                count += self._remove(left)
                start = left
            self._add(start, count)

    def _any_start(self, length: int) -> int:
        starts = self._starts_of[length]
        start = starts.pop()  # set.pop stays cheap however many were taken before
        starts.add(start)
        return start

    def _add(self, start: int, length: int) -> None:
        self._length_at[start] = length
        self._start_ending_at[start + length] = start
        if length not in self._starts_of:
            self._starts_of[length] = set()
            bisect.insort(self._lengths, length)
        self._starts_of[length].add(start)

    def _remove(self, start: int) -> int:
        length = self._length_at.pop(start)
        del self._start_ending_at[start + length]
        starts = self._starts_of[length]
        starts.discard(start)
        if not starts:
            del self._starts_of[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        return length


def page_runs(pages: list[int]) -> list[tuple[int, int]]:
    """[(start, count)] of consecutive page ids, in the order given."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs

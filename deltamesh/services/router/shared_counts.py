"""Counts that the processes of one router (--api-server-count) share: per worker, how many requests and KV pages each
process holds admitted there (router/admission.py), so that each process's admission sees what every other has
admitted the moment it does, not a report later.

The memory is one anonymous file (memfd) that the router's parent makes and its processes inherit: a row per
process, each row an open-addressing table of (worker key, slots, pages), int64 each, that only its own process
writes (so no lock: a reader may see one entry's two counts a moment apart, an off-by-one-request that lasts
microseconds). A worker's key is a hash of its address that every process computes alike; an entry, once made,
never moves, so a process remembers where each worker's entry is in each row. A process started again in place of
one that died clears its row first: the requests it counted died with the process."""

from __future__ import annotations

import hashlib
import mmap
import os

CAPACITY = 16384  # workers one process can count over its life (the router's mesh: decode workers)
_FIELDS = 3  # key, slots, pages


def worker_key(address: str) -> int:
    """A non-zero int64 naming the worker at `address`, the same in every process (0 marks a free entry)."""
    return int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8).digest(), "little", signed=True) or 1


def create(processes: int, capacity: int = CAPACITY) -> int:
    """A new shared file for `processes` rows, zeroed: its descriptor, for the processes to inherit."""
    fd = os.memfd_create("deltamesh-router-counts", os.MFD_CLOEXEC)
    os.ftruncate(fd, processes * capacity * _FIELDS * 8)
    return fd


class SharedCounts:
    def __init__(self, fd: int, processes: int, index: int, capacity: int = CAPACITY):
        """Row `index` of `processes` in the shared file `fd` is this process's."""
        self.processes, self.index, self.capacity = processes, index, capacity
        self._map = mmap.mmap(fd, processes * capacity * _FIELDS * 8)
        self._cells = memoryview(self._map).cast("q")
        self._where: dict[tuple[int, int], int] = {}  # (row, worker key) -> the entry's first cell
        self.full = False  # this process's row had no room for a worker (its counts stay its own)
        start, end = index * capacity * _FIELDS, (index + 1) * capacity * _FIELDS
        self._cells[start:end] = memoryview(bytes((end - start) * 8)).cast("q")

    def close(self) -> None:
        self._cells.release()
        self._map.close()

    def _find(self, row: int, key: int, make: bool = False) -> int | None:
        """The first cell of `key`'s entry in `row` (made there with `make`: own row only), None if it has none."""
        cell = self._where.get((row, key))
        if cell is not None:
            return cell
        cells, base = self._cells, row * self.capacity * _FIELDS
        slot = key % self.capacity
        for _ in range(self.capacity):
            cell = base + slot * _FIELDS
            found = cells[cell]
            if found == key:
                self._where[(row, key)] = cell
                return cell
            if found == 0:
                if not make:
                    return None
                cells[cell] = key  # the counts are zero: a reader of this entry finds nothing counted yet
                self._where[(row, key)] = cell
                return cell
            slot = (slot + 1) % self.capacity
        self.full = True
        return None

    def add(self, address: str, slots: int, pages: int) -> None:
        """Count `slots` requests and `pages` pages more (or fewer) as held by this process on the worker."""
        cell = self._find(self.index, worker_key(address), make=True)
        if cell is not None:
            self._cells[cell + 1] += slots
            self._cells[cell + 2] += pages

    def others(self, address: str) -> tuple[int, int]:
        """(slots, pages) that the other processes hold on the worker."""
        key, slots, pages = worker_key(address), 0, 0
        for row in range(self.processes):
            if row == self.index:
                continue
            cell = self._find(row, key)
            if cell is not None:
                slots += self._cells[cell + 1]
                pages += self._cells[cell + 2]
        return slots, pages

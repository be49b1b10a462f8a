"""Which workers' prefix caches hold which prompts' prefixes, as the workers report them (WorkerReport, pushed to
every process of every router: services/common/reports.py). What cache-aware routing and the P/D decider read, so
that every router process sends a repeated prefix to the worker that holds it, whichever process the request
reached.

A worker reports the keys (deltamesh/protocol/blocks.py) of the prefixes a request can resume after: its cached
blocks that end at a GDN checkpoint, and the blocks its finished sequences' tails follow. The index maps each key to
the workers holding it, so a prompt's best holders come from one dictionary look-up per block of the prompt,
however many workers there are."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self):
        # key -> the address of the one worker holding it, or the set of those (when several do): most keys are held
        # by one worker, and an address is one shared string per worker, so a key costs one dictionary entry
        self._holders: dict[int, str | set[str]] = {}
        self._keys: dict[str, set[int]] = {}  # each worker's keys, to replace or forget them

    def __len__(self) -> int:
        """Distinct keys held by some worker."""
        return len(self._holders)

    def entries(self) -> int:
        """(worker, key) pairs."""
        return sum(len(keys) for keys in self._keys.values())

    def keys_of(self, worker: str) -> int:
        return len(self._keys.get(worker, ()))

    def replace(self, worker: str, keys: Iterable[int]) -> None:
        """The worker's whole set of keys (its first report on a stream)."""
        self.forget(worker)
        self.add(worker, keys)

    def add(self, worker: str, keys: Iterable[int]) -> None:
        own = self._keys.setdefault(worker, set())
        holders = self._holders
        for k in keys:
            if k in own:
                continue
            own.add(k)
            held = holders.get(k)
            if held is None:
                holders[k] = worker
            elif isinstance(held, str):
                holders[k] = {held, worker}
            else:
                held.add(worker)

    def remove(self, worker: str, keys: Iterable[int]) -> None:
        own = self._keys.get(worker)
        if not own:
            return
        for k in keys:
            if k in own:
                own.discard(k)
                self._drop(k, worker)

    def forget(self, worker: str) -> None:
        """A worker gone (or whose stream broke: its next stream starts with the whole set)."""
        for k in self._keys.pop(worker, ()):
            self._drop(k, worker)

    def _drop(self, key: int, worker: str) -> None:
        held = self._holders[key]
        if isinstance(held, str):
            del self._holders[key]
            return
        held.discard(worker)
        if len(held) == 1:
            self._holders[key] = next(iter(held))

    def matched(self, keys: Sequence[int]) -> dict[str, int]:
        """For a prompt's block keys (first to last): each worker holding some of them, with how many blocks of the
        prompt it can resume after (the depth of the deepest key it holds)."""
        out: dict[str, int] = {}
        holders = self._holders
        for depth in range(len(keys), 0, -1):  # deepest first: a worker's first hit is its deepest
            held = holders.get(keys[depth - 1])
            if held is None:
                continue
            if isinstance(held, str):
                out.setdefault(held, depth)
            else:
                for w in held:
                    out.setdefault(w, depth)
        return out

"""Python's cyclic garbage collector, kept off the serving path. A full (oldest-generation) collection walks every
tracked object of the process (in a worker, torch's, Triton's and the model's start-up objects) and stops every
thread while it does (bench/RESULTS.md, "Garbage collection pauses"). So a service process collects once when it is
ready and freezes what is alive then (`gc.freeze`: later collections skip it, as vLLM does after its engine starts),
and the engine's periodic log line reports the collector's pauses (`GcPauses`)."""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import dataclass


@dataclass
class Frozen:
    objects: int  # moved into the permanent generation
    collect_ms: float  # the start-up collection before it, which no serving thread waited for


def freeze_startup_heap() -> Frozen:
    """Collect, then move every object alive now into the collector's permanent generation. The collection runs
    with the process's pause counters (`GcPauses`) detached: it happens before the service says it is ready, so
    it is the start-up's time (`Frozen.collect_ms`, for the "serving" log line), not a pause a request waited for."""
    counters = [c for c in gc.callbacks if isinstance(c, _Hook)]
    for c in counters:
        gc.callbacks.remove(c)
    try:
        started = time.perf_counter()
        gc.collect()
        collect_ms = (time.perf_counter() - started) * 1e3
        gc.freeze()
    finally:
        gc.callbacks.extend(counters)
    return Frozen(gc.get_freeze_count(), round(collect_ms, 1))


class GcPauses:
    """The collector's pauses in this process since the last `take`: their total and the longest, and how many
    full collections ran. Process-wide: a pause stops every thread, whichever one set the collection off."""

    def __init__(self) -> None:
        self._started: float | None = None
        self.total_s = self.longest_s = 0.0
        self.full = 0
        # The collector's list holds a hook with a weak reference only, removed when this object goes: a counter
        # whose owner never closed it (a step report a test made) leaves no hook behind, called on every collection.
        self._hook = _Hook(self)
        gc.callbacks.append(self._hook)
        weakref.finalize(self, _unhook, self._hook)

    def on_phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause, self._started = time.perf_counter() - self._started, None
        self.total_s += pause
        self.longest_s = max(self.longest_s, pause)
        self.full += info.get("generation") == 2

    def take(self) -> tuple[float, float, int]:
        """(total seconds, longest seconds, full collections) since the last take; starts counting anew."""
        out = (self.total_s, self.longest_s, self.full)
        self.total_s = self.longest_s = 0.0
        self.full = 0
        return out

    @property
    def counting(self) -> bool:
        return self._hook in gc.callbacks

    def close(self) -> None:
        _unhook(self._hook)


class _Hook:
    """gc.callbacks' entry for one GcPauses, through a weak reference."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = weakref.ref(pauses)

    def __call__(self, phase: str, info: dict) -> None:
        pauses = self._pauses()
        if pauses is not None:
            pauses.on_phase(phase, info)


def _unhook(hook: _Hook) -> None:
    if hook in gc.callbacks:
        gc.callbacks.remove(hook)

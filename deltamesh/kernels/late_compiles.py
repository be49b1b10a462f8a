"""Triton kernels compiled while a worker serves, after its warm-up.

Triton compiles a kernel once per specialization: its constexprs and the types of its arguments, integers also by
whether each is 1 or a multiple of 16. `engine.assembly.warm_up` runs each kind of step so that these compiles
happen before the worker serves; one it missed happens inside a client's step and costs that step up to a second
on a host whose on-disk Triton cache is empty. `LateCompiles` watches for them once the worker is ready, through
Triton's compile hooks (as vLLM's compile monitor does): each is logged with the kernel, its specialization and its
milliseconds, and counted, so that a serving run names what the warm-up must also run (a kernel found in Triton's
on-disk cache passes the same hooks: it counts too, in a few ms). Triton's hooks are the process's, so there is
one watch a process (`WATCH`), started by each engine once it is ready.
"""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger("deltamesh.kernels")


class LateCompiles:
    def __init__(self):
        self.count = 0  # compiles seen since start()
        self.seconds = 0.0
        self._began: dict[str, float] = {}
        self._previous: tuple | None = None  # the hooks found installed, called in turn and put back by stop()

    def start(self) -> bool:
        """Watch from now on (again: no change); False where Triton (or its hooks) is not there."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if self._previous is not None or not hasattr(runtime, "jit_post_compile_hook"):
            return self._previous is not None
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def began(**kwargs):
            self._began[str(kwargs.get("key"))] = time.perf_counter()
            return before(**kwargs) if before is not None else None  # a true value would skip the compile

        def compiled(**kwargs):
            self._compiled(kwargs)
            return after(**kwargs) if after is not None else None

        self._previous = (before, after)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = began, compiled
        return True

    def stop(self) -> None:
        if self._previous is None:
            return
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous
        self._previous = None

    def _compiled(self, kwargs: dict) -> None:
        began = self._began.pop(str(kwargs.get("key")), None)
        seconds = time.perf_counter() - began if began is not None else 0.0
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(fn)
        self.count += 1
        self.seconds += seconds
        log.warning(
            "kernel compiled while serving: the warm-up did not run this specialization",
            kernel=name,
            specialization=str(kwargs.get("repr", ""))[:400],
            # the compile cache key: every argument's type and specialization (Triton's repr stops short of them,
            # as stage L's first run showed)
            key=str(kwargs.get("key", ""))[:2000],
            ms=round(1e3 * seconds, 1),
        )


WATCH = LateCompiles()

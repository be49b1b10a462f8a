"""bench/transfer.py --overlap-model: a real engine loop beside the pulls, and what its step times show (before
the first pull vs during pulls)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

Spans = list[tuple[float, float]]  # (start, end) perf_counter() pairs


class EngineLoop:
    """A real engine loop on its own thread, as a worker runs one beside its event loop, stepped back to back:
    `decode` (puller side): `batch` requests of `context` tokens, one token each per step; `prefill` (holder
    side): `batch` requests prefilling a `context`-token chunk each per step. `steps`: (start, end) of each."""

    def __init__(self, model: str, device: str, side: str, batch: int, context: int):
        from bench.common import decode_items, prefill_items
        from deltamesh.engine import EngineConfig
        from deltamesh.engine.core import EngineCore

        weights = "auto" if any(Path(model).glob("*.safetensors")) else "dummy"
        self.core = EngineCore(
            EngineConfig(
                model=model,
                load_format=weights,
                device=device,
                max_num_seqs=batch,
                num_kv_pages=batch * -(-(context + 64) // 16) + 64,
                max_model_len=context + 64,
                max_num_batched_tokens=max(1024, context * (batch if side == "prefill" else 1)),
                prefix_cache=False,
            )
        )
        make_items = prefill_items if side == "prefill" else decode_items
        self.items = make_items(self.core, batch, context)
        self.steps: Spans = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{side}-loop", daemon=True)

    def _run(self) -> None:
        from bench.gpu_common import host_list

        while not self._stop.is_set():
            t0 = time.perf_counter()
            host_list(self.core.runner.execute(self.items).argmax(-1))  # the engine's own wait for the GPU
            self.steps.append((t0, time.perf_counter()))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> Spans:
        self._stop.set()
        self._thread.join()
        return self.steps


def _stats(xs: list[float]) -> dict:
    xs = sorted(x * 1e3 for x in xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
    return {"steps": len(xs), "median_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": xs[-1] if xs else None}


def _overlaps(start: float, end: float, spans) -> bool:
    return any(start < s1 and end > s0 for s0, s1 in spans)


def overlap_summary(steps: Spans, pulls: Spans, checks: Spans = (), warm_ups: Spans = ()) -> dict:
    """Engine step times before the first pull or warm-up that overlap none of the benchmark's own GPU work (idle)
    vs steps that overlapped a pull; and, apart, the steps that overlapped a pull but none of `checks` (the
    benchmark's own GPU work beside the loop: on the decode side its check of the pulled bytes, right after each
    pull; on the prefill side its seeding and summing of each offered state) vs those that overlapped one; and
    the longest step that overlapped each warm-up."""
    first = min(start for start, _ in [*pulls, *warm_ups])
    idle = [end - start for start, end in steps if end <= first and not _overlaps(start, end, checks)]
    overlapping = [[end - start for start, end in steps if _overlaps(start, end, [pull])] for pull in pulls]
    during = [end - start for start, end in steps if _overlaps(start, end, pulls)]
    pull_only = [e - s for s, e in steps if _overlaps(s, e, pulls) and not _overlaps(s, e, checks)]
    checking = [end - start for start, end in steps if _overlaps(start, end, checks)]
    longest_in = lambda span: max((e - s for s, e in steps if _overlaps(s, e, [span])), default=0)  # noqa: E731
    return {
        "idle": _stats(idle),
        "during_pulls": _stats(during),
        "during_pulls_not_checks": _stats(pull_only),
        "during_checks": _stats(checking),
        "pulls": len(pulls),
        "max_step_ms_per_pull": [round(max(x) * 1e3, 3) if x else None for x in overlapping],
        "pull_ms": [round((p1 - p0) * 1e3, 3) for p0, p1 in pulls],
        "warm_up_ms": [round((w1 - w0) * 1e3, 3) for w0, w1 in warm_ups],
        "max_step_ms_per_warm_up": [round(longest_in(w) * 1e3, 3) for w in warm_ups],
    }

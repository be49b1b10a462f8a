"""bench/serve.py's per-request timing (what a backend records of a streamed response) and vLLM's serving
metrics over it: throughput, goodput, and mean / median / std / percentiles of TTFT, TPOT, ITL and E2E latency."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestOutput:
    prompt_len: int
    expected_output_len: int
    sent: bool = False  # False: never issued, or still waiting for a --max-concurrency slot when stopped
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per chunk after the first
    latency: float = 0.0  # seconds, send -> last token
    start_time: float = 0.0  # perf_counter() when sent
    queue_time: float = 0.0  # waiting for a --max-concurrency slot
    finish_reason: str | None = None
    generated_text: str = ""
    error: str = ""
    _last: float = 0.0
    _chunks: int = 0

    def token_event(self, ts: float) -> None:
        """A streamed chunk carrying generated token(s) arrived at ts."""
        if self._chunks == 0:
            self.ttft = ts - self.start_time
        else:
            self.itl.append(ts - self._last)
        self._last = ts
        self._chunks += 1

    def finish(self, complete: bool) -> None:
        self.latency = (self._last - self.start_time) if self._chunks else 0.0
        if not self.output_tokens:
            self.output_tokens = self._chunks
        if not self.error:
            if not self._chunks:
                self.error = "no token was streamed"
            elif not complete:
                self.error = "the stream ended before its end marker"
            elif self.finish_reason in ("abort", "error"):
                self.error = f"finish_reason {self.finish_reason}"
        self.success = not self.error


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/percentiles in ms of values in seconds (zeros when empty, as vLLM)."""
    a = np.asarray(values if values else [0.0], dtype=float) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        out[f"p{percentile_label(p)}"] = float(np.percentile(a, p))
    return out


def percentile_label(p: float) -> str:
    """A percentile as its result keys name it: 90 -> "90", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    outputs: list[RequestOutput], duration: float, goodput: dict[str, float], percentiles: list[float]
) -> dict[str, Any]:
    """vLLM's serving metrics (vllm/benchmarks/serve.py calculate_metrics) over the finished requests."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    itls = [x for o in ok for x in o.itl]
    all_tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for o in ok]
    tpots = [t for o, t in zip(ok, all_tpots) if o.output_tokens > 1]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    good = 0
    if goodput:
        per_slo = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            good += all(per_slo[k][i] <= v / 1000.0 for k, v in goodput.items())
    dur = duration if duration > 0 else float("nan")
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": sum(o.sent and not o.success for o in outputs),
        "not_sent": sum(not o.sent for o in outputs),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if goodput else None,
        "input_throughput": total_input / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
    }
    m.update(_peaks(ok))
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, percentiles).items():
            m[f"{stat}_{key}_ms"] = value
    return m


def _peaks(ok: list[RequestOutput]) -> dict[str, float]:
    """Peak output tokens in any one-second bucket, and the peak number of requests in flight."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(o.start_time for o in ok)
    buckets = np.zeros(int(math.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1)
    for o in ok:
        t = o.start_time + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            buckets[int(t - t0)] += 1
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return {"max_output_tokens_per_s": float(buckets.max()), "max_concurrent_requests": peak}


def wave_ttfts(start_times: list, ttfts: list, concurrency: int) -> dict[str, float | None]:
    """A closed-loop point's first tokens split into its first wave (the first `concurrency` sends, all at once) and
    the requests sent as earlier ones ended: the median TTFT of each (ms), and over how many seconds the later ones
    were sent (a staggered second wave is served as it arrives; one sent all at once waits as the first wave did).
    Failed requests (start time None or TTFT 0) are left out."""
    sent = sorted((s, t) for s, t in zip(start_times, ttfts) if s is not None and t)
    first, later = sent[:concurrency], sent[concurrency:]
    median = lambda xs: float(np.median(xs)) * 1000 if xs else None  # noqa: E731
    return {
        "ttft_wave1_median_ms": median([t for _, t in first]),
        "ttft_later_median_ms": median([t for _, t in later]),
        "later_sends_span_s": later[-1][0] - later[0][0] if later else None,
    }

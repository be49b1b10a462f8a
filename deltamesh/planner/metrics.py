"""What a simulated run gives, in `bench/serve.py`'s (and `vllm bench serve`'s) terms: TTFT from the request's
send to its first token, TPOT per request (end - first token) / (tokens - 1), throughput over the run's duration
(first send to last end) counting input and output tokens, and goodput: requests within the SLA per second."""

from __future__ import annotations

import math

import numpy as np

from deltamesh.planner.simulator import SimResult
from deltamesh.planner.traffic import Sla


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(result: SimResult, sla: Sla) -> dict:
    done = [r for r in result.requests if not math.isnan(r.finished)]
    ttfts = [(r.first_token - r.sent) * 1e3 for r in done]
    tpots_all = [(r.finished - r.first_token) * 1e3 / (r.output_len - 1) if r.output_len > 1 else 0.0 for r in done]
    tpots = [t for t, r in zip(tpots_all, done) if r.output_len > 1]
    ttft_limit, tpot_limit = sla.request_limits()
    good = [r for r, a, b in zip(done, ttfts, tpots_all) if a <= ttft_limit and b <= tpot_limit]
    dur = result.duration or math.nan
    gpus = result.layout.gpus
    tokens = sum(r.prompt_len + r.output_len for r in done)
    summary = {
        "layout": result.layout.label,
        "gpus": gpus,
        "requests": len(result.requests),
        "unfinished": len(result.requests) - len(done),
        "duration_s": result.duration,
        "ttft_p50_ms": _pct(ttfts, 50),
        "ttft_p90_ms": _pct(ttfts, 90),
        "ttft_p99_ms": _pct(ttfts, 99),
        "ttft_mean_ms": float(np.mean(ttfts)) if ttfts else math.nan,
        "tpot_p50_ms": _pct(tpots, 50) if tpots else 0.0,
        "tpot_p90_ms": _pct(tpots, 90) if tpots else 0.0,
        "tpot_mean_ms": float(np.mean(tpots)) if tpots else 0.0,
        "e2e_p50_ms": _pct([(r.finished - r.sent) * 1e3 for r in done], 50),
        "requests_per_s": len(done) / dur,
        "tok_s": tokens / dur,
        "tok_s_per_gpu": tokens / dur / gpus,
        "output_tok_s_per_gpu": sum(r.output_len for r in done) / dur / gpus,
        "good_requests": len(good),
        "goodput_req_s": len(good) / dur,
        "goodput_tok_s_per_gpu": sum(r.prompt_len + r.output_len for r in good) / dur / gpus,
        "busy": {k: round(v, 3) for k, v in result.busy.items()},
        "preemptions": result.preemptions,
        "steps": result.steps,
    }
    misses = sla.misses(summary)
    summary["meets_sla"] = not misses
    summary["misses"] = misses
    return summary

"""A periodic line on the engine's work (as vLLM logs its throughput every few seconds): what the steps since the
last line were and cost, so that a worker that slows down shows why in its own log.

Per window: steps, of which mixed (carrying prompt tokens beside decodes), decode steps replayed from CUDA graphs
and mixed steps replayed piece by piece (cuda_graphs.py); the mean
wall time of a step on the stepping thread; on CUDA, the share of the window the GPU spent inside steps (the rest
it waited for the host: work between steps that async scheduling did not hide, or no work at all); prompt and
generated tokens per second; running and waiting requests; KV pages in use by requests and cached; prefix-cache
hits; preemptions; with speculative decoding, the acceptance rate of each draft position (accepted there per
verifying request: a draft counts only after those before it were accepted) and the tokens a verifying request
gained per step; where steps sampled under a grammar (structured outputs), how many and the host's mean time on
their bitmasks; Triton kernels compiled in the window (kernels/late_compiles.py: specializations the warm-up did
not run), where there were any; the garbage collector's pauses in the window (total, longest, full
collections: engine/gc_pauses.py), where there were any."""

from __future__ import annotations

import time

import structlog

from deltamesh.engine.gc_pauses import GcPauses
from deltamesh.kernels import late_compiles

log = structlog.get_logger("deltamesh.engine")

INTERVAL_S = 10.0


class StepReport:
    def __init__(self, core, interval_s: float = INTERVAL_S):
        self.core, self.interval_s = core, interval_s
        self.step_seconds = 0.0  # wall time of the steps since the last line, added by the stepping thread
        self._last = self._counters()
        self._since = time.monotonic()
        self.gc = GcPauses()

    def _counters(self) -> dict:
        s = self.core.stats
        return {
            "steps": s.steps,
            "mixed": s.mixed_steps,
            "graphs": self.core.runner.graph_steps,
            "piecewise": self.core.runner.piecewise_steps,
            "prompt": s.prompt_tokens,
            "generated": s.generation_tokens,
            "hits": s.prefix_cache_hits,
            "preemptions": self.core.scheduler.num_preemptions,
            "gpu_ms": s.gpu_step_ms,
            "drafts": s.spec_drafts,
            "accepted_at": list(s.spec_accepted_at),
            "grammar_steps": s.grammar_mask_steps,
            "grammar_s": s.grammar_mask_seconds,
            "compiles": late_compiles.WATCH.count,
        }

    def maybe_log(self) -> dict | None:
        """Log (and return) the window's line once `interval_s` has passed and some step ran in it."""
        now = time.monotonic()
        if now - self._since < self.interval_s:
            return None
        counters = self._counters()
        delta = {k: counters[k] - self._last[k] for k in counters if k != "accepted_at"}
        accepted_at = [now_n - then_n for now_n, then_n in zip(counters["accepted_at"], self._last["accepted_at"])]
        seconds, step_seconds = now - self._since, self.step_seconds
        self._last, self._since, self.step_seconds = counters, now, 0.0
        if not delta["steps"]:
            return None
        loads = self.core.loads()
        line = {
            "steps": delta["steps"],
            "mixed_steps": delta["mixed"],
            "graph_steps": delta["graphs"],
            "piecewise_steps": delta["piecewise"],
            "step_ms": round(1e3 * step_seconds / delta["steps"], 3),
            "prompt_tok_s": round(delta["prompt"] / seconds, 1),
            "generated_tok_s": round(delta["generated"] / seconds, 1),
            "running": loads["running"],
            "waiting": loads["waiting"],
            "kv_pages_used": loads["kv_pages_used"],
            "kv_pages_cached": loads["kv_pages_cached"],
            "kv_pages_total": loads["kv_pages_total"],
            "prefix_cache_hits": delta["hits"],
            "preemptions": delta["preemptions"],
        }
        k = self.core.config.speculative_tokens
        if k and delta["drafts"]:  # each position's acceptance rate: accepted there per verifying request
            verified = delta["drafts"] / k
            line["spec_acceptance"] = [round(n / verified, 3) for n in accepted_at[:k]]
            line["spec_tokens_per_step"] = round(1 + sum(accepted_at[:k]) / verified, 3)
        if delta["grammar_steps"]:
            line["grammar_steps"] = delta["grammar_steps"]
            line["grammar_mask_ms"] = round(1e3 * delta["grammar_s"] / delta["grammar_steps"], 3)
        if delta["compiles"]:
            line["late_compiles"] = delta["compiles"]
        gc_s, gc_longest_s, gc_full = self.gc.take()
        if gc_s:  # the collector stopped every thread this long
            line["gc_ms"] = round(1e3 * gc_s, 1)
            line["gc_longest_ms"] = round(1e3 * gc_longest_s, 1)
            line["gc_full"] = gc_full
        if self.core.launcher.gpu_timed:
            line["gpu_busy_pct"] = round(delta["gpu_ms"] / (10 * seconds), 1)  # ms over s x 1000, in percent
        log.info("engine steps", **line)
        return line

    def close(self) -> None:
        self.gc.close()

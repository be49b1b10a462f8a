"""What an engine counts (EngineStats, kept by the step loop and the prefix cache) and reports as its load
(`loads`: what a worker sends the router and exports as metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from deltamesh.engine.interfaces import PrefixCacheInterface, SchedulerInterface


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    mixed_steps: int = 0  # steps that carried prompt tokens (eager, or piecewise CUDA graphs: cuda_graphs.py)
    finished: dict[str, int] = field(default_factory=dict)
    prefix_cache_hits: int = 0  # admissions that started from a cached prefix
    prefix_cache_hit_tokens: int = 0  # prompt tokens those admissions did not compute
    checkpoints_saved: int = 0
    checkpoints_evicted: int = 0
    pulled_prefix_tokens: int = 0  # prompt tokens whose state was pulled from another worker, not computed
    # CUDA: the GPU's time from the start to the end of each step's forward pass, summed. Steps queue behind each
    # other, so wall time minus this is time the GPU had no step to run (host work not hidden behind the GPU).
    gpu_step_ms: float = 0.0
    # Requests the engine prefilled itself (not transferred in): from arrival to their first scheduled step (queue)
    # and to their first token on the host, summed, and how many of each
    queue_seconds: float = 0.0
    queued: int = 0
    first_token_seconds: float = 0.0
    first_tokens: int = 0
    # Steps that sampled a row under a grammar (structured outputs), and the host's time filling and queueing their
    # bitmasks (grammar.GrammarMasks), summed
    grammar_mask_steps: int = 0
    grammar_mask_seconds: float = 0.0

    def reset(self) -> None:
        """Every count back to zero, in place: the parts that count hold this object."""
        zero = EngineStats()
        for f in fields(self):
            setattr(self, f.name, getattr(zero, f.name))


def loads(
    scheduler: SchedulerInterface, prefix_cache: PrefixCacheInterface | None, num_held: int, stats: EngineStats
) -> dict:
    usage = scheduler.usage()
    cached_only = prefix_cache.reclaimable() if prefix_cache is not None else 0
    return {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "held": num_held,
        # pages requests hold; pages only the prefix cache holds are free on demand, so they count apart
        "kv_pages_used": usage.kv_pages_used - cached_only,
        "kv_pages_cached": cached_only,
        "kv_pages_total": usage.kv_pages_total,
        "state_slots_used": usage.state_slots_used,
        "state_slots_total": usage.state_slots_total,
        "prefix_cache_pages": prefix_cache.num_pages if prefix_cache is not None else 0,
        "prefix_cache_checkpoints": prefix_cache.num_checkpoints if prefix_cache is not None else 0,
        "prefix_cache_bytes": prefix_cache.num_bytes if prefix_cache is not None else 0,  # vs the budget
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "checkpoints_saved": stats.checkpoints_saved,
        "checkpoints_evicted": stats.checkpoints_evicted,
    }

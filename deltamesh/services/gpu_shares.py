"""`deltamesh serve`'s memory check, before it starts anything: each worker's budget holds its weights, pools and
one request at --max-model-len (engine/memory_budget.py), and the workers that share a GPU fit on it together.

Workers share a GPU when `--gpus` lists fewer GPUs than they need (`--gpus 0` with 1P+1D puts both on GPU 0). Each
then needs a budget of its own: without --gpu-memory-utilization a worker sizes its KV cache from the memory free when
it starts, so the first to get there would leave the others a sliver. Their fractions may add up to 1 at most."""

from __future__ import annotations

from dataclasses import dataclass

from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.memory_budget import MemoryBudgetError, check_before_start


@dataclass(frozen=True)
class PlannedWorker:
    name: str  # e.g. "decode-0"
    engine: EngineConfig
    gpus: tuple[str, ...]  # the GPU ids it takes (empty on the CPU)


def check_workers(workers: list[PlannedWorker]) -> None:
    """Raise MemoryBudgetError (one line, naming the worker) when workers that share a GPU do not fit on it or a
    worker's budget cannot serve."""
    check_sharing(workers)
    for w in workers:
        try:
            check_before_start(w.engine)
        except MemoryBudgetError as e:
            raise MemoryBudgetError(f"{w.name}: {e}") from None


def check_sharing(workers: list[PlannedWorker]) -> None:
    """The part of `check_workers` about workers sharing a GPU: each has a budget, their fractions fit."""
    sharing: dict[str, list[PlannedWorker]] = {}
    for w in workers:
        for gpu in w.gpus:
            sharing.setdefault(gpu, []).append(w)
    for gpu, together in sharing.items():
        if len(together) < 2:
            continue
        names = ", ".join(w.name for w in together)
        unbounded = [w.name for w in together if not _bounded(w.engine)]
        if unbounded:
            raise MemoryBudgetError(
                f"{names} share GPU {gpu}, and {', '.join(unbounded)} would size its KV cache from the memory free "
                f"when it starts, leaving the others a sliver: give each a share, e.g. --gpu-memory-utilization "
                f"{0.9 / len(together):.2f}, or --prefill-gpu-memory-utilization / --decode-gpu-memory-utilization"
            )
        fractions = [w.engine.gpu_memory_utilization or 0.0 for w in together]
        if sum(fractions) > 1 + 1e-9:
            raise MemoryBudgetError(
                f"{names} share GPU {gpu}, and their --gpu-memory-utilization add up to {sum(fractions):g} "
                f"({' + '.join(f'{f:g}' for f in fractions)}), over the whole GPU"
            )


def _bounded(engine: EngineConfig) -> bool:
    """Its KV cache has a size of its own, not the GPU's free memory's."""
    return (
        engine.gpu_memory_utilization is not None or engine.kv_cache_memory_gb is not None or bool(engine.num_kv_pages)
    )

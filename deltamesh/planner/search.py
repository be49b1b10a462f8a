"""The layouts a plan weighs, and how it picks: every profile (colocated) and every pair of profiles (prefill,
decode), every per-worker limit given (max_num_seqs x max_num_batched_tokens, the same for both roles, so that
one `deltamesh serve` deploys it), each with the fewest workers that meet the SLA within the GPU budget, found
by simulating the traffic on it (simulator.py).

More workers never make a layout slower for the same traffic, so the fewest that meet the SLA come from a
bisection over the count (colocated), or over the decode workers for each prefill count (disaggregated), the
counts that would need more GPUs than the best layout found so far skipped. Among the layouts that meet the SLA
the winner has the highest goodput per GPU (for a fixed traffic: the fewest GPUs)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltamesh.planner.layouts import Layout, Role
from deltamesh.planner.metrics import summarize
from deltamesh.planner.profile import Profile
from deltamesh.planner.simulator import SimulationError, simulate
from deltamesh.planner.traffic import Sla, Traffic

GPU_SEQS, GPU_BUDGETS = (16, 32, 64, 128, 256), (4096, 16384)
CPU_SEQS, CPU_BUDGETS = (8, 16, 32), (512, 2048)


@dataclass
class Evaluated:
    layout: Layout
    summary: dict | None  # None: the layout cannot serve the traffic at all
    error: str = ""

    @property
    def meets(self) -> bool:
        return bool(self.summary and self.summary["meets_sla"])

    def rank(self) -> tuple:
        """Higher is better: meets the SLA, goodput per GPU, fewer GPUs, lower TTFT p90, then the smaller
        limits (less memory for the same result)."""
        s, roles = self.summary or {}, self.layout.roles
        return (
            self.meets,
            s.get("goodput_tok_s_per_gpu", 0.0),
            -self.layout.gpus,
            -s.get("ttft_p90_ms", math.inf),
            -roles[0].max_num_seqs,
            -roles[0].max_num_batched_tokens,
        )


@dataclass
class Plan:
    traffic: Traffic
    sla: Sla
    max_gpus: int
    max_model_len: int
    evaluated: list[Evaluated] = field(default_factory=list)

    def best(self, disaggregated: bool) -> Evaluated | None:
        """The best layout of the kind: the best that meets the SLA, else the one that came closest."""
        pool = [e for e in self.evaluated if e.summary and e.layout.disaggregated == disaggregated]
        return max(pool, key=Evaluated.rank, default=None)

    @property
    def winner(self) -> Evaluated | None:
        pool = [e for e in (self.best(False), self.best(True)) if e is not None and e.meets]
        return max(pool, key=Evaluated.rank, default=None)


class Planner:
    def __init__(
        self,
        profiles: list[Profile],
        traffic: Traffic,
        sla: Sla,
        max_gpus: int = 8,
        seqs: Sequence[int] | None = None,
        budgets: Sequence[int] | None = None,
        disaggregated_only: bool = False,
        colocated_only: bool = False,
        path_ms: float = 0.0,
    ):
        if not profiles:
            raise ValueError("a plan needs at least one profile")
        models = {p.model.get("name") for p in profiles}
        if len(models) > 1:
            raise ValueError(f"profiles of different models: {', '.join(sorted(map(str, models)))}")
        if max_gpus < 1:
            raise ValueError(f"max GPUs must be >= 1, got {max_gpus}")
        if path_ms < 0:
            raise ValueError(f"the serving path's time must be >= 0 ms, got {path_ms}")
        gpu = profiles[0].is_gpu
        self.profiles, self.traffic, self.sla, self.max_gpus = profiles, traffic, sla, max_gpus
        self.path_ms = path_ms  # the serving path's time each way (simulator.py)
        self.seqs = tuple(seqs or (GPU_SEQS if gpu else CPU_SEQS))
        self.budgets = tuple(budgets or (GPU_BUDGETS if gpu else CPU_BUDGETS))
        if min(self.seqs) < 1 or min(self.budgets) < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens candidates must be >= 1")
        self.kinds = [k for k, skip in ((False, disaggregated_only), (True, colocated_only)) if not skip]
        if True in self.kinds:
            for p in profiles:
                if not p.transfer.points:
                    raise ValueError(
                        f"profile {p.name} has no state-transfer times, which prefill/decode layouts need: give "
                        "--transfer FILE (a bench/transfer.py JSON or a profile that has them), or --colocated-only"
                    )
        page = max(p.memory.page_size for p in profiles)
        longest = max(p + o for _, p, o in traffic.requests())
        self.max_model_len = -(-longest // page) * page
        self.plan = Plan(traffic, sla, max_gpus, self.max_model_len)
        self._seen: dict[tuple, Evaluated] = {}

    def run(self) -> Plan:
        for seqs in self.seqs:
            for budget in self.budgets:
                if False in self.kinds:
                    for prof in self.profiles:
                        self._colocated(prof, seqs, budget)
                if True in self.kinds:
                    for pre in self.profiles:
                        for dec in self.profiles:
                            self._disaggregated(pre, dec, seqs, budget)
        return self.plan

    # ---- one layout -----------------------------------------------------------------------------------
    def evaluate(self, layout: Layout) -> Evaluated:
        key = (layout.label, *((id(r.profile), r.max_num_seqs, r.max_num_batched_tokens) for r in layout.roles))
        if key in self._seen:
            return self._seen[key]
        try:
            result = Evaluated(layout, summarize(simulate(layout, self.traffic, self.path_ms), self.sla))
        except SimulationError as e:
            result = Evaluated(layout, None, str(e))
        self._seen[key] = result
        self.plan.evaluated.append(result)
        return result

    def _fewest(self, make, most: int) -> Evaluated | None:
        """The layout of the fewest workers in 1..most (make(n)) that meets the SLA; else the one of `most`."""
        if most < 1:
            return None
        top = self.evaluate(make(most))
        if not top.meets:
            return top
        lo, hi, best = 1, most, top
        while lo < hi:
            mid = (lo + hi) // 2
            e = self.evaluate(make(mid))
            if e.meets:
                hi, best = mid, e
            else:
                lo = mid + 1
        return best

    def _colocated(self, prof: Profile, seqs: int, budget: int) -> None:
        def make(n: int) -> Layout:
            return Layout(self.max_model_len, colocated=Role(prof, n, seqs, budget))

        self._fewest(make, self.max_gpus // prof.gpus_per_worker)

    def _disaggregated(self, pre: Profile, dec: Profile, seqs: int, budget: int) -> None:
        gp, gd = pre.gpus_per_worker, dec.gpus_per_worker
        best_gpus = self.max_gpus + 1
        x = 1
        while x * gp + gd <= min(self.max_gpus, best_gpus - 1):

            def make(y: int, x: int = x) -> Layout:
                return Layout(self.max_model_len, prefill=Role(pre, x, seqs, budget), decode=Role(dec, y, seqs, budget))

            found = self._fewest(make, (min(self.max_gpus, best_gpus - 1) - x * gp) // gd)
            if found is not None and found.meets:
                best_gpus = found.layout.gpus
            x += 1


def plan(profiles: list[Profile], traffic: Traffic, sla: Sla, **options) -> Plan:
    return Planner(profiles, traffic, sla, **options).run()

"""A plan as people read it (a table, the verdict, the commands that deploy the winner) and as JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence

from deltamesh.planner.search import Evaluated, Plan

COLUMNS = [
    "layout",
    "GPUs",
    "limits",
    "TTFT p50 / p90 ms",
    "TPOT p50 / p90 ms",
    "tok/s/GPU",
    "goodput tok/s/GPU",
    "SLA",
]


def table(headers: Sequence[str], rows: list[Sequence[str]]) -> str:
    """A Markdown table, aligned so that it also reads well in a terminal."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([line(cells[0]), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, cells[1:])])


def _num(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def row(e: Evaluated) -> list[str]:
    lay, s = e.layout, e.summary
    limits = lay.roles[0].limits()
    if s is None:
        return [lay.label, str(lay.gpus), limits, "-", "-", "-", "-", f"cannot serve: {e.error}"]
    return [
        lay.label,
        str(lay.gpus),
        limits,
        f"{_num(s['ttft_p50_ms'])} / {_num(s['ttft_p90_ms'])}",
        f"{_num(s['tpot_p50_ms'])} / {_num(s['tpot_p90_ms'])}",
        _num(s["tok_s_per_gpu"]),
        _num(s["goodput_tok_s_per_gpu"]),
        "yes" if s["meets_sla"] else "no: " + "; ".join(s["misses"]),
    ]


def shown(plan: Plan, top: int) -> list[Evaluated]:
    """The best `top` layouts evaluated, best first (of layouts that differ only in limits that never bound them,
    the first: the smallest), and the best of each kind whatever its place."""
    ranked = sorted((e for e in plan.evaluated if e.summary), key=Evaluated.rank, reverse=True)
    out: list[Evaluated] = []
    seen = set()
    for e in ranked:
        same = (e.layout.label, *row(e)[3:])
        if same not in seen and len(out) < top:
            seen.add(same)
            out.append(e)
    for best in (plan.best(False), plan.best(True)):
        if best is not None and best not in out:
            out.append(best)
    return out


def verdict(plan: Plan) -> list[str]:
    colocated, disaggregated, winner = plan.best(False), plan.best(True), plan.winner
    lines = []
    for word, best in (("colocated", colocated), ("disaggregated", disaggregated)):
        if best is None:
            continue
        s = best.summary
        assert s is not None, "a best layout was evaluated"
        status = "meets the SLA" if best.meets else "closest, misses the SLA (" + "; ".join(s["misses"]) + ")"
        lines.append(
            f"best {word}: {best.layout.describe()} on {best.layout.gpus} GPU(s): TTFT p50/p90 "
            f"{_num(s['ttft_p50_ms'])}/{_num(s['ttft_p90_ms'])} ms, TPOT p50 {_num(s['tpot_p50_ms'])} ms, goodput "
            f"{_num(s['goodput_tok_s_per_gpu'])} tok/s/GPU; {status}"
        )
    if winner is None:
        lines.append(f"no layout within {plan.max_gpus} GPU(s) meets the SLA: allow more GPUs or loosen the SLA")
        return lines
    other = disaggregated if winner is colocated else colocated
    if other is not None and other.meets:
        assert winner.summary is not None and other.summary is not None, "both were evaluated"
        ratio = winner.summary["goodput_tok_s_per_gpu"] / other.summary["goodput_tok_s_per_gpu"]
        lines.append(
            f"winner: {winner.layout.label}, {ratio:.2f}x the goodput per GPU of {other.layout.label} "
            f"({winner.layout.gpus} GPU(s) against {other.layout.gpus})"
        )
    else:
        kind = "disaggregated" if winner.layout.disaggregated else "colocated"
        lines.append(
            f"winner: {winner.layout.label}; no {'colocated' if kind != 'colocated' else 'P/D'} layout "
            f"within {plan.max_gpus} GPU(s) meets the SLA"
        )
    return lines


def render(plan: Plan, top: int = 10) -> str:
    head = [
        f"traffic: {plan.traffic.describe()}",
        f"SLA: {plan.sla.describe()}; at most {plan.max_gpus} GPU(s); context {plan.max_model_len}",
        f"{len(plan.evaluated)} layouts simulated",
        "",
        table(COLUMNS, [row(e) for e in shown(plan, top)]),
        "",
        *verdict(plan),
    ]
    if plan.evaluated and not plan.evaluated[0].layout.roles[0].profile.is_gpu:
        head.insert(2, "CPU profiles: a 'GPU' here is one worker process, at the profile's torch threads")
    if plan.winner is not None:
        head += ["", "deploy it with:", *("  " + c for c in plan.winner.layout.commands())]
    return "\n".join(head)


def to_json(plan: Plan) -> dict:
    def entry(e: Evaluated | None) -> dict | None:
        if e is None:
            return None
        return {"layout": e.layout.to_json(), "summary": e.summary, "error": e.error or None}

    winner = plan.winner
    return {
        "traffic": {
            "input_len": plan.traffic.input_len.spec,
            "output_len": plan.traffic.output_len.spec,
            "request_rate": plan.traffic.request_rate,
            "concurrency": plan.traffic.concurrency,
            "burstiness": plan.traffic.burstiness,
            "num_requests": plan.traffic.num_requests,
            "seed": plan.traffic.seed,
        },
        "sla": plan.sla.limits(),
        "max_gpus": plan.max_gpus,
        "max_model_len": plan.max_model_len,
        "best_colocated": entry(plan.best(False)),
        "best_disaggregated": entry(plan.best(True)),
        "winner": entry(winner),
        "commands": winner.layout.commands() if winner else [],
        "verdict": verdict(plan),
        "evaluated": [entry(e) for e in plan.evaluated],
    }

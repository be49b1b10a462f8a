"""Fitting the step model (profile.py) to what the profiler measured, and how far the fit lands from each point."""

from __future__ import annotations

import itertools

import numpy as np

from deltamesh.planner.profile import DecodeGrid, PrefillModel


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of the unconstrained solutions over each subset of
    columns whose solution is non-negative (three columns: eight subsets)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ coef - y) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(a.shape[1])
                best[list(cols)] = coef
    return best


def fit_prefill(flows: list[dict]) -> tuple[PrefillModel, list[float]]:
    """Flows of whole prompts: {"steps", "tokens", "pairs", "ms"} each (ms summed over the flow's steps). Fits
    ms = a·steps + b·tokens + c·pairs/1e6 in relative terms (each flow's error counts as a fraction of its time,
    so short flows weigh as much as long ones). Returns the model and each flow's relative error."""
    if not flows:
        raise ValueError("no prefill measurements to fit")
    a = np.array([[f["steps"], f["tokens"], f["pairs"] / 1e6] for f in flows], dtype=float)
    y = np.array([f["ms"] for f in flows], dtype=float)
    w = 1.0 / y
    coef = _nonnegative_lstsq(a * w[:, None], y * w)
    model = PrefillModel(*map(float, coef))
    errors = [float((a[i] @ coef - y[i]) / y[i]) for i in range(len(flows))]
    return model, errors


def fit_mixed(points: list[dict], prefill: PrefillModel, decode: DecodeGrid) -> tuple[float, list[float]]:
    """Prompts prefilled beside a decode batch: {"steps" (those carrying both), "decode_only_steps", "decodes",
    "context", "tokens", "pairs", "ms"} each. The extra ms m of a mixed step over decode_ms + the chunks' own ms,
    by least squares per mixed step; it may be negative (a mixed step reads the weights once for both). Returns
    m and each point's relative error."""

    def base(p: dict) -> float:
        steps = p["steps"] + p["decode_only_steps"]
        return steps * decode.ms(p["decodes"], p["context"]) + prefill.chunk_ms(p["tokens"], p["pairs"])

    points = [p for p in points if p["steps"]]
    if not points:
        return 0.0, []
    m = sum(p["ms"] - base(p) for p in points) / sum(p["steps"] for p in points)
    return float(m), [float((base(p) + m * p["steps"] - p["ms"]) / p["ms"]) for p in points]

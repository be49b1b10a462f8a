"""bench/transfer.py's tables: every row's sizes and times, where a pull's time goes, the dropped first pulls,
and with --overlap-model the engine loop's step times before and during the pulls."""

from __future__ import annotations

import argparse

from bench.common import human_bytes, table
from bench.transfer_runs import PHASES


def print_report(args: argparse.Namespace, rows: list[dict], overlaps: list[dict]) -> None:
    print(
        table(
            ["mode", "tokens", "KV bytes", "GDN bytes", "buffers", "median ms", "mean ms", "GB/s"],
            [
                [
                    r["mode"],
                    r["tokens"],
                    human_bytes(r["kv_bytes"]),
                    human_bytes(r["gdn_bytes"]),
                    r["buffers"],
                    r["seconds_median"] * 1e3,
                    r["seconds_mean"] * 1e3,
                    r["gb_per_s"],
                ]
                for r in rows
            ],
        )
    )
    pulls = [r for r in rows if "phases_ms_median" in r]
    print("\nwhere a pull's time goes (median ms; one clock for both processes)")
    print(
        table(["mode", "tokens", *PHASES], [[r["mode"], r["tokens"], *r["phases_ms_median"].values()] for r in pulls])
    )
    print("\nthe dropped first pull of each row (ms)")
    firsts = [r["first_pull"] for r in pulls]
    print(
        table(
            ["mode", "tokens", "pull", *PHASES],
            [[r["mode"], r["tokens"], f["seconds"] * 1e3, *f["phases"].values()] for r, f in zip(pulls, firsts)],
        )
    )
    if not overlaps:
        return
    where = "a decode loop in the puller" if args.overlap_side == "decode" else "a prefill loop in the holder"
    own = "check of the pulled bytes" if args.overlap_side == "decode" else "seeding and summing of each offer"
    print(
        f"\n{where} (step ms): before the first pull vs steps that overlapped a pull (median / p99 / max);"
        f" apart: steps that overlapped a pull but not the benchmark's own {own}, and those that did"
    )

    def span(st: dict) -> str:
        return f"{st['median_ms']:.1f} / {st['p99_ms']:.1f} / {st['max_ms']:.1f}" if st["steps"] else "-"

    print(
        table(
            [
                "mode",
                "model",
                "batch",
                "context" if args.overlap_side == "decode" else "chunk",
                "idle steps",
                "idle",
                "during steps",
                "during pulls",
                "pull, no bench work",
                "during bench work",
            ],
            [
                [
                    o["mode"],
                    o["model"],
                    o["batch"],
                    o["context"],
                    o["idle"]["steps"],
                    span(o["idle"]),
                    o["during_pulls"]["steps"],
                    span(o["during_pulls"]),
                    span(o["during_pulls_not_checks"]),
                    span(o["during_checks"]),
                ]
                for o in overlaps
            ],
        )
    )
    longest = "longest step during it (ms)"
    print(
        table(
            ["mode", "warm-up ms", longest, "first pull ms", longest],
            [
                [
                    o["mode"],
                    ", ".join(map(str, o["warm_up_ms"])) or "-",
                    ", ".join(map(str, o["max_step_ms_per_warm_up"])) or "-",
                    o["pull_ms"][0],
                    o["max_step_ms_per_pull"][0],
                ]
                for o in overlaps
            ],
        )
    )

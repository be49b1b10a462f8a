"""The planner's predictions next to measurements: the same layout, flags and load simulated (deltamesh/planner)
and served, with the error of each median (TTFT, TPOT) and of the throughput.

    # CPU: profile the default model, serve it colocated and 1P+1D (bench/serve.py at each concurrency), simulate
    # the same points
    python bench/plan_check.py cpu --out bench/results/plan_check_cpu.json
    # GPU: profiles made on an H200 against the tables in bench/RESULTS.md (bench/plan_measured.json)
    python bench/plan_check.py gpu --profile qwen3.5-9b=h200-9b.json --profile qwen3.5-35b-a3b=h200-35b.json

CPU: before the points of a layout, a few requests one at a time measure the serving path's time (the client's
TTFT less the workers' own, halved: `measure_path`), which the simulation is given (`path_ms`).

Throughput is total (input + output) tokens/s per GPU (CPU: per worker process, each with --torch-threads). The issue's goal: TTFT and TPOT
medians within 15 %, tokens/s within 10 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, free_port, ints, stop_group, table, write_result
from bench.disagg_sweep import run_point, wait_ready
from bench.server_side import PointObserver
from deltamesh.engine.defaults import DEFAULT_MODEL
from deltamesh.planner.layouts import Layout, Role
from deltamesh.planner.metrics import summarize
from deltamesh.planner.profile import Profile, TransferModel
from deltamesh.planner.simulator import simulate
from deltamesh.planner.traffic import LengthDist, Sla, Traffic

MEASURED = ROOT / "bench" / "plan_measured.json"
GOALS = {"ttft": 0.15, "tpot": 0.15, "tok_s": 0.10}
PATH_PROBES = 8  # requests one at a time that measure the serving path (measure_path)


def predict(
    layout: Layout, input_len: int, output_len: int, concurrency: int, requests: int, path_ms: float = 0.0
) -> dict:
    traffic = Traffic(LengthDist.parse(str(input_len)), LengthDist.parse(str(output_len)), None, concurrency, requests)
    s = summarize(simulate(layout, traffic, path_ms), Sla())
    return {"ttft_ms": s["ttft_p50_ms"], "tpot_ms": s["tpot_p50_ms"], "tok_s_per_gpu": s["tok_s_per_gpu"]}


def compare(rows: list[dict]) -> str:
    """rows: each with "label", "measured" and "predicted" ({ttft_ms, tpot_ms, tok_s_per_gpu}); adds "error"."""
    lines, met = [], {k: 0 for k in GOALS}
    for r in rows:
        m, p = r["measured"], r["predicted"]
        r["error"] = {
            "ttft": p["ttft_ms"] / m["ttft_ms"] - 1,
            "tpot": p["tpot_ms"] / m["tpot_ms"] - 1,
            "tok_s": p["tok_s_per_gpu"] / m["tok_s_per_gpu"] - 1,
        }
        for k, goal in GOALS.items():
            met[k] += abs(r["error"][k]) <= goal
        cells = [
            f"{m[key]:,.{d}f} / {p[key]:,.{d}f} ({r['error'][e]:+.0%})"
            for key, e, d in (("ttft_ms", "ttft", 0), ("tpot_ms", "tpot", 2), ("tok_s_per_gpu", "tok_s", 0))
        ]
        lines.append([r["label"], *cells])
    out = table(["point", "TTFT ms measured / predicted", "TPOT ms", "tok/s per GPU"], lines)
    within = ", ".join(f"{k} {met[k]}/{len(rows)} within {GOALS[k]:.0%}" for k in GOALS)
    return f"{out}\n{within}"


# ---- CPU: measure now --------------------------------------------------------------------------------------
def make_profile(path: Path, threads: int) -> Profile:
    cmd = [
        sys.executable,
        "-m",
        "deltamesh.services.cli",
        "profile",
        "--out",
        str(path),
        "--torch-threads",
        str(threads),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return Profile.load(path)


def start_mesh(args, colocated: bool, work: Path) -> tuple[list[subprocess.Popen], str, list[str]]:
    """A router and its workers started one by one (as `deltamesh serve` starts them, but with --torch-threads
    of our choosing: serve shares the cores out, and on a shared machine torch's threads stall when the cores
    are oversubscribed), on free loopback ports, sharing a mesh secret. Returns the processes, the REST base URL
    and the workers' /metrics URLs."""
    env = {**os.environ, "DELTAMESH_MESH_SECRET": secrets.token_urlsafe(32)}
    http, control = free_port(), free_port()
    cli = [sys.executable, "-m", "deltamesh.services.cli"]
    router = [*cli, "router", "--model", args.model, "--grpc-port", str(free_port()), "--control-port", str(control)]
    commands = [[*router, "--http-port", str(http), "--log-level", "warning"]]
    metrics = []
    for role in ["colocated"] if colocated else ["prefill", "decode"]:
        worker = [*cli, role, "--model", args.model, "--router", f"127.0.0.1:{control}", "--log-level", "warning"]
        metrics.append(f"http://127.0.0.1:{(metrics_port := free_port())}/metrics")
        worker += ["--metrics-port", str(metrics_port)]
        worker += ["--torch-threads", str(args.torch_threads), "--max-num-seqs", str(args.max_num_seqs)]
        worker += [
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-model-len",
            str(args.max_model_len),
        ]
        commands.append(worker)
    procs = []
    for i, cmd in enumerate(commands):
        log = (work / f"mesh-{i}.log").open("w")
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    return procs, f"http://127.0.0.1:{http}", metrics


def measure_path(args, base: str, pgid: int, metrics: list[str], work: Path) -> float:
    """The serving path's time each way (the simulation's `path_ms`): a few requests one at a time, their mean
    TTFT at the client less the mean the workers' servicers saw (request arrival to first token), halved (to the
    worker and back). The engine's time is in both, so what is left is the REST gateway's, the router's and the
    loopback's."""
    observer = PointObserver(pgid, metrics)
    got = run_point(base, args.model, args.input_len, 2, 1, PATH_PROBES, work / "path.json", 300, observer=observer)
    if "error" in got or "worker_ttft_mean_ms" not in got:
        raise RuntimeError(f"measuring the serving path: {got.get('error', got)}")
    return max(0.0, (got["ttft_mean_ms"] - got["worker_ttft_mean_ms"]) / 2)


def check_cpu(args) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    prof = Profile.load(args.profile) if args.profile else make_profile(work / "profile.json", args.torch_threads)
    rows = []
    for colocated in (True, False):
        role = Role(prof, 1, args.max_num_seqs, args.max_num_batched_tokens)
        layout = (
            Layout(args.max_model_len, colocated=role)
            if colocated
            else Layout(args.max_model_len, prefill=role, decode=role)
        )
        if args.setups and layout.label not in args.setups:
            continue
        procs, base, metrics = start_mesh(args, colocated, work)
        try:
            wait_ready(procs[0], f"{base}/ready", work / "mesh-0.log", 300)
            path_ms = measure_path(args, base, procs[0].pid, metrics, work)
            print(f"{layout.label}: the serving path takes {path_ms:.1f} ms each way", flush=True)
            for c in args.concurrency:
                n = args.waves * c
                got = run_point(base, args.model, args.input_len, args.output_len, c, n, work / f"{c}.json", 900)
                if "error" in got:
                    raise RuntimeError(f"{layout.label} at {c}: {got['error']}")
                rows.append(
                    {
                        "label": f"{layout.label}, {args.input_len}/{args.output_len}, c={c}",
                        "layout": layout.label,
                        "concurrency": c,
                        "measured": {
                            "ttft_ms": got["ttft_median_ms"],
                            "tpot_ms": got["tpot_median_ms"],
                            "tok_s_per_gpu": got["total_tok_s_per_gpu"] / layout.gpus,
                        },
                        "predicted": predict(layout, args.input_len, args.output_len, c, n, path_ms),
                        "path_ms": path_ms,
                    }
                )
                print(rows[-1], flush=True)
        finally:
            for proc in reversed(procs):
                stop_group(proc)
    return rows


# ---- GPU: profiles against the tables ------------------------------------------------------------------------
def check_gpu(args) -> list[dict]:
    data = json.loads(MEASURED.read_text())
    profiles = {}
    for spec in args.profile:
        shape, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--profile {spec!r}: expected SHAPE=FILE, e.g. qwen3.5-9b=h200-9b.json")
        profiles[shape] = Profile.load(path)
    rows, elsewhere = [], set()
    for row in data["rows"]:
        prof = profiles.get(row["shape"])
        if prof is None:
            continue
        setup = data["setups"][row["setup"]]
        gpu = prof.provenance.get("machine", {}).get("gpu")
        if gpu != setup["gpu"]:  # a profile predicts only the GPU it was made on
            elsewhere.add(f"{row['setup']} ({setup['gpu']}): measured on another GPU than {prof.name} ({gpu})")
            continue
        weights = prof.engine.get("quantization", "auto")
        if weights != setup.get("quantization", "auto"):  # ... and only the weights it ran
            elsewhere.add(f"{row['setup']}: other weights than {prof.name} ({weights})")
            continue
        if row["layout"] != "colocated" and not prof.transfer.points:
            # the pulls measured beside the setup's own rows, else those of the shape between two GPUs
            moves = setup.get("transfers") or data["transfers"].get(row["shape"])
            if moves is None:
                continue
            prof = dataclasses.replace(prof, transfer=TransferModel(moves["points"], moves["source"]))
        # a worker's pool as measured where it had a share of a GPU (the profile sizes one for a whole GPU)
        kv_tokens = setup.get("kv_tokens_per_worker")
        role = Role(prof, 1, setup["max_num_seqs"], setup["max_num_batched_tokens"], kv_tokens)
        if row["layout"] == "colocated":
            layout = Layout(setup["max_model_len"], colocated=role)
        else:
            layout = Layout(setup["max_model_len"], prefill=role, decode=role, one_gpu=setup.get("one_gpu", False))
        c = row["concurrency"]
        n = max(setup["waves"] * c, setup["min_prompts"])
        rows.append(
            {
                "label": f"{row['shape']} {layout.label} {row['input']}/{row['output']} c={c} ({row['setup']})",
                **row,
                "measured": {k: row[k] for k in ("ttft_ms", "tpot_ms", "tok_s_per_gpu")},
                # the serving path each way, where the setup's rows measured it (client TTFT less the worker's)
                "predicted": predict(layout, row["input"], row["output"], c, n, setup.get("path_ms", 0.0)),
                "profile": prof.name,
                "prefix_cache": {"profile": prof.engine.get("prefix_cache"), "measured": setup["prefix_cache"]},
            }
        )
    for skipped in sorted(elsewhere):
        print(f"not compared: {skipped}")
    if not rows:
        raise SystemExit(
            "no measured row has a profile of its GPU: --profile qwen3.5-9b=FILE and/or qwen3.5-35b-a3b=FILE"
        )
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu", help="profile, serve and simulate the default model on this machine's CPU")
    cpu.add_argument("--model", default=str(DEFAULT_MODEL))
    cpu.add_argument("--input-len", type=int, default=256)
    cpu.add_argument("--output-len", type=int, default=32)
    cpu.add_argument("--concurrency", type=ints, default=[1, 4, 8])
    cpu.add_argument("--waves", type=int, default=3, help="requests per point = waves x concurrency")
    cpu.add_argument("--max-num-seqs", type=int, default=32)
    cpu.add_argument("--max-num-batched-tokens", type=int, default=1024)
    cpu.add_argument("--setups", type=lambda s: s.split(","), default=None, help="colocated,1P1D (default both)")
    cpu.add_argument("--torch-threads", type=int, default=1, help="each worker's, and the profile's")
    cpu.add_argument("--profile", help="a profile (transfers included) made with those threads (default: made now)")
    gpu = sub.add_parser("gpu", help="GPU profiles against the measured tables of bench/plan_measured.json")
    gpu.add_argument("--profile", action="append", default=[], help="SHAPE=FILE, e.g. qwen3.5-9b=h200-9b.json")
    for mode in (cpu, gpu):
        mode.add_argument("--out", default=None, help="JSON results (default bench/results/plan_check_MODE.json)")
    args = p.parse_args(argv)
    if args.mode == "cpu":
        args.max_model_len = args.input_len + args.output_len + 16
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = check_cpu(args) if args.mode == "cpu" else check_gpu(args)
    print(compare(rows))
    out = write_result(args.out or RESULTS / f"plan_check_{args.mode}.json", {"mode": args.mode, "rows": rows})
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

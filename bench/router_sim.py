"""The router at scale, by SIMULATION: the real router process(es) in front of simulated workers (bench/sim_workers.py:
gRPC servers that speak the workers' protocol, register, report loads and stream tokens at a set rate, with no
model behind them), so that what is measured is the router alone.

    python bench/router_sim.py tokens --api grpc --concurrency 64 --max-tokens 256
        router CPU seconds per streamed token (the router's processes, user + system, from /proc), tokens/s
    python bench/router_sim.py mesh --prefill 500 --decode 500 --processes 1,2,4
        a router of N processes in front of that many simulated workers: time to see them all, idle router CPU and
        control-plane traffic, RSS, then streamed tokens/s (gRPC) per process and router CPU per token
    python bench/router_sim.py index --workers 1000 --keys 10000
        the prefix index's size and lookup cost, the routing decision's latency (in process: bench/sim_index.py)

Every run prints a table and writes JSON (the command, the date and the machine included) to bench/results/."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, busy_warning, free_port, print_table, stop_group, write_result
from bench.sim_load import process_cpu_seconds, run_load, tree_pids
from deltamesh.services.router.control import read_loads

LOGS = RESULTS / "router_sim_logs"


class SimMesh:
    """A router (`deltamesh router`, its own process group) and a process of simulated workers registered with it."""

    def __init__(
        self, prefill: int, decode: int, token_rate: float, router_args: list[str], router_tree: str | None = None
    ):
        """`router_tree`: run the router of that checkout of deltamesh (its protos generated), e.g. the commit before
        a change, against the same simulated workers."""
        LOGS.mkdir(parents=True, exist_ok=True)
        self.secret = secrets.token_hex(16)
        self.grpc_port, self.control_port, self.http_port = free_port(), free_port(), free_port()
        env = {**os.environ, "DELTAMESH_MESH_SECRET": self.secret, "PYTHONUNBUFFERED": "1"}
        tree = Path(router_tree).resolve() if router_tree else ROOT
        router_env = {**env, "PYTHONPATH": f"{tree}:{tree / 'sdk' / 'src'}"} if router_tree else env
        self.router = subprocess.Popen(
            [sys.executable, "-m", "deltamesh.services.cli", "router", "--grpc-port", str(self.grpc_port)]
            + ["--control-port", str(self.control_port), "--http-port", str(self.http_port), "--log-level", "warning"]
            + router_args,
            cwd=tree,
            env=router_env,
            stdout=(LOGS / "router.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "sim_workers.py"), "--router", f"127.0.0.1:{self.control_port}"]
            + ["--prefill", str(prefill), "--decode", str(decode), "--token-rate", str(token_rate)],
            cwd=ROOT,
            env=env,
            stdout=(LOGS / "workers.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.expected = prefill + decode

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc, name in ((self.router, "router"), (self.workers, "workers")):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{(LOGS / f'{name}.log').read_text()[-3000:]}")
            try:
                if sum(w.healthy for w in read_loads(f"127.0.0.1:{self.control_port}", self.secret)) >= self.expected:
                    return
            except Exception:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not every simulated worker became healthy within {timeout:g} s")

    def router_cpu(self) -> float:
        return process_cpu_seconds(tree_pids(self.router.pid))

    def close(self) -> None:
        stop_group(self.router)
        stop_group(self.workers)


def measure_tokens(
    mesh: SimMesh, api: str, concurrency: int, duration: float, max_tokens: int, py_spy: str | None = None
) -> dict:
    """One load point; with `py_spy`, py-spy samples the router's processes meanwhile (collapsed stacks to
    `py_spy`.<api>.txt, for flame graphs or grep)."""
    target = f"127.0.0.1:{mesh.grpc_port}" if api == "grpc" else f"http://127.0.0.1:{mesh.http_port}"
    asyncio.run(run_load(api, target, min(concurrency, 8), 3.0, max_tokens))  # warm-up: connections, first calls
    spies = [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(duration)),
                "--format",
                "raw",
                "--rate",
                "200",
            ]
            + ["--output", f"{py_spy}.{api}.{pid}.txt", "--nonblocking"]
            + (["--native"] if os.environ.get("PY_SPY_NATIVE") else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in (tree_pids(mesh.router.pid) if py_spy else [])
    ]
    cpu0 = mesh.router_cpu()
    result = asyncio.run(run_load(api, target, concurrency, duration, max_tokens))
    cpu = mesh.router_cpu() - cpu0
    for spy in spies:
        spy.wait()
    return {
        "api": api,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "streams": result.streams,
        "tokens": result.tokens,
        "errors": len(result.errors),
        "wrong_streams": result.wrong,
        "seconds": round(result.seconds, 2),
        "tokens_per_s": round(result.tokens / result.seconds, 1),
        "router_cpu_s": round(cpu, 3),
        "router_cpu_us_per_token": round(1e6 * cpu / max(result.tokens, 1), 1),
        "router_core_share": round(cpu / result.seconds, 3),
        "first_errors": result.errors[:3],
    }


def cmd_tokens(args) -> None:
    mesh = SimMesh(args.prefill, args.decode, args.token_rate, args.router_arg, args.router_tree)
    rows = []
    try:
        mesh.wait_ready()
        for api in args.api.split(","):
            rows.append(measure_tokens(mesh, api, args.concurrency, args.duration, args.max_tokens, args.py_spy))
            print_table(
                rows[-1:],
                [
                    "api",
                    "concurrency",
                    "tokens",
                    "errors",
                    "wrong_streams",
                    "tokens_per_s",
                    "router_cpu_us_per_token",
                    "router_core_share",
                ],
            )
    finally:
        mesh.close()
    warning = busy_warning("router CPU seconds per token are robust to it; tokens/s are not")
    if warning:
        print(warning)
    write_result(args.out or RESULTS / "router_sim_tokens.json", {"rows": rows, "warning": warning})


def control_traffic() -> dict:
    """Per second, between the simulated workers' last two SIM_CONTROL lines: registration calls and their payload
    bytes (request + reply messages, without HTTP/2 framing), report messages and their payload bytes."""
    lines = [line.split()[1:] for line in (LOGS / "workers.log").read_text().splitlines() if line.startswith("SIM_")]
    samples = [dict(kv.split("=") for kv in line) for line in lines if line and "=" in line[0]]
    if len(samples) < 2:
        return {}
    a, b = samples[-2], samples[-1]
    dt = float(b["seconds"]) - float(a["seconds"])
    return {
        f"{name}_per_s": round((float(b[name]) - float(a[name])) / dt, 1)
        for name in ("calls", "bytes", "reports", "report_bytes")
    }


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return round(total / 1024, 1)


def cmd_mesh(args) -> None:
    rows = []
    for n in (int(x) for x in args.processes.split(",")):
        started = time.monotonic()
        mesh = SimMesh(args.prefill, args.decode, args.token_rate, ["--api-server-count", str(n), *args.router_arg])
        try:
            mesh.wait_ready(args.ready_timeout)
            row = {"processes": n, "workers": args.prefill + args.decode}
            row["all_healthy_s"] = round(time.monotonic() - started, 1)
            time.sleep(args.idle)  # settled: every stream past its first report
            cpu0 = mesh.router_cpu()
            time.sleep(args.idle)
            row["idle_router_cores"] = round((mesh.router_cpu() - cpu0) / args.idle, 3)
            row.update(control_traffic())
            row["idle_rss_mib"] = rss_mib(tree_pids(mesh.router.pid))
            load = measure_tokens(mesh, "grpc", args.concurrency, args.duration, args.max_tokens)
            row["loaded_rss_mib"] = rss_mib(tree_pids(mesh.router.pid))
            row["tokens_per_s"] = load["tokens_per_s"]
            row["tokens_per_s_per_process"] = round(load["tokens_per_s"] / n, 1)
            row["router_cpu_us_per_token"] = load["router_cpu_us_per_token"]
            row["router_cores"] = load["router_core_share"]
            row["errors"], row["wrong_streams"] = load["errors"], load["wrong_streams"]
            rows.append(row)
            print_table([row], list(row))
        finally:
            mesh.close()
    warning = busy_warning("every figure here is bounded by the machine, not the router")
    if warning:
        print(warning)
    write_result(args.out or RESULTS / "router_sim_mesh.json", {"rows": rows, "warning": warning})


def cmd_index(args) -> None:
    from bench.sim_index import run_index

    row = run_index(args.workers, args.keys, args.prompt_tokens, args.decisions)
    print_table([row], list(row))
    warning = busy_warning("the microsecond figures are upper bounds")
    if warning:
        print(warning)
    write_result(args.out or RESULTS / "router_sim_index.json", {"rows": [row], "warning": warning})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokens", help="router CPU per streamed token")
    t.add_argument("--api", default="grpc,rest", help="grpc, rest or both (comma-separated)")
    t.add_argument("--concurrency", type=int, default=64)
    t.add_argument("--duration", type=float, default=20.0)
    t.add_argument("--max-tokens", type=int, default=256)
    t.add_argument("--token-rate", type=float, default=50.0, help="tokens/s of each simulated stream")
    t.add_argument("--prefill", type=int, default=2)
    t.add_argument("--decode", type=int, default=2)
    t.add_argument("--router-arg", action="append", default=[], help="one more flag for the router (repeatable)")
    t.add_argument("--router-tree", help="run the router of this checkout (before/after comparisons)")
    t.add_argument("--py-spy", help="sample the router with py-spy (on PATH) into PREFIX.<api>.<pid>.txt")
    t.add_argument("--out")
    m = sub.add_parser("mesh", help="N router processes in front of many simulated workers")
    m.add_argument("--prefill", type=int, default=500)
    m.add_argument("--decode", type=int, default=500)
    m.add_argument("--processes", default="1,2,4", help="router process counts to run, comma-separated")
    m.add_argument("--token-rate", type=float, default=50.0, help="tokens/s of each simulated stream")
    m.add_argument("--concurrency", type=int, default=128)
    m.add_argument("--duration", type=float, default=20.0)
    m.add_argument("--max-tokens", type=int, default=128)
    m.add_argument("--idle", type=float, default=10.0, help="seconds of each idle measurement")
    m.add_argument("--ready-timeout", type=float, default=600.0)
    m.add_argument("--router-arg", action="append", default=[], help="one more flag for the router (repeatable)")
    m.add_argument("--out")
    i = sub.add_parser("index", help="prefix index size and lookup cost, routing decision latency (in process)")
    i.add_argument("--workers", type=int, default=1000)
    i.add_argument("--keys", type=int, default=10_000, help="cached-prefix keys each worker reports")
    i.add_argument("--prompt-tokens", type=int, default=2048)
    i.add_argument("--decisions", type=int, default=2000)
    i.add_argument("--out")
    args = p.parse_args()
    {"tokens": cmd_tokens, "mesh": cmd_mesh, "index": cmd_index}[args.command](args)


if __name__ == "__main__":
    main()

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

`tokens` and `mesh` take --worker-processes W (the simulated workers spread over W processes) and --client-processes
C (the load generator in C processes, each at concurrency / C): one process of each runs out of CPU before the router
does on a few cores (bench/RESULTS.md, "The router at scale"). Every row also gives the simulation's own cores
(sim_workers_cores, client_cores): a row where they are near W or C was bounded by the simulation.

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

from bench.common import RESULTS, ROOT, busy_warning, exit_on_sigterm, free_port, print_table, stop_group, write_result
from bench.sim_load import process_cpu_seconds, run_load, tree_pids
from bench.sim_processes import LoadClients, shares
from deltamesh.services.router.control import read_loads

LOGS = RESULTS / "router_sim_logs"


class SimMesh:
    """A router (`deltamesh router`, its own process group) and `worker_processes` processes of simulated workers
    registered with it, each with its share of the prefill and decode workers."""

    def __init__(
        self,
        prefill: int,
        decode: int,
        token_rate: float,
        router_args: list[str],
        router_tree: str | None = None,
        worker_processes: int = 1,
        feeds: bool = True,
    ):
        """`router_tree`: run the router of that checkout of deltamesh (its protos generated), e.g. the commit before
        a change, against the same simulated workers. `feeds`: the simulated decode workers serve the token feed
        (else each request streams on its own, as before #45)."""
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
        if not 1 <= worker_processes <= prefill + decode:
            raise ValueError(f"--worker-processes {worker_processes}: from 1 to the {prefill + decode} workers")
        self.workers: list[subprocess.Popen] = []
        self.worker_logs: list[Path] = []
        seed_base = 0  # each prefill worker its own seed (its cached keys) across the processes
        for i, (p, d) in enumerate(zip(shares(prefill, worker_processes), shares(decode, worker_processes))):
            self.worker_logs.append(LOGS / (f"workers-{i}.log" if worker_processes > 1 else "workers.log"))
            self.workers.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "sim_workers.py"), "--router"]
                    + [f"127.0.0.1:{self.control_port}", "--prefill", str(p), "--decode", str(d)]
                    + ["--token-rate", str(token_rate), "--seed-base", str(seed_base)]
                    + ([] if feeds else ["--no-feed"]),
                    cwd=ROOT,
                    env=env,
                    stdout=self.worker_logs[-1].open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            seed_base += p
        self.expected = prefill + decode

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        logs = [(self.router, LOGS / "router.log"), *zip(self.workers, self.worker_logs)]
        while time.monotonic() < deadline:
            for proc, log in logs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{log.stem} exited:\n{log.read_text()[-3000:]}")
            try:
                if sum(w.healthy for w in read_loads(f"127.0.0.1:{self.control_port}", self.secret)) >= self.expected:
                    return
            except Exception:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not every simulated worker became healthy within {timeout:g} s")

    def router_cpu(self) -> float:
        return process_cpu_seconds(tree_pids(self.router.pid))

    def workers_cpu(self) -> float:
        return process_cpu_seconds([pid for proc in self.workers for pid in tree_pids(proc.pid)])

    def close(self) -> None:
        stop_group(self.router)
        for proc in self.workers:
            stop_group(proc)


def measure_tokens(
    mesh: SimMesh,
    api: str,
    concurrency: int,
    duration: float,
    max_tokens: int,
    py_spy: str | None = None,
    client_processes: int = 1,
) -> dict:
    """One load point, its streams from `client_processes` processes; with `py_spy`, py-spy samples the router's
    processes meanwhile (collapsed stacks to `py_spy`.<api>.txt, for flame graphs or grep)."""
    target = f"127.0.0.1:{mesh.grpc_port}" if api == "grpc" else f"http://127.0.0.1:{mesh.http_port}"
    asyncio.run(run_load(api, target, min(concurrency, 8), 3.0, max_tokens))  # warm-up: connections, first calls
    clients = LoadClients(api, target, concurrency, duration, max_tokens, client_processes, LOGS)  # started, idle
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
    cpu0, workers_cpu0 = mesh.router_cpu(), mesh.workers_cpu()
    result = clients.run()
    cpu, workers_cpu = mesh.router_cpu() - cpu0, mesh.workers_cpu() - workers_cpu0
    for spy in spies:
        spy.wait()
    return {
        "api": api,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "worker_processes": len(mesh.workers),
        "client_processes": client_processes,
        "streams": result.streams,
        "tokens": result.tokens,
        "errors": len(result.errors),
        "wrong_streams": result.wrong,
        "seconds": round(result.seconds, 2),
        "tokens_per_s": round(result.tokens / result.seconds, 1),
        "router_cpu_s": round(cpu, 3),
        "router_cpu_us_per_token": round(1e6 * cpu / max(result.tokens, 1), 1),
        "router_core_share": round(cpu / result.seconds, 3),
        "sim_workers_cores": round(workers_cpu / result.seconds, 3),
        "client_cores": round(result.cpu_s / result.seconds, 3),
        "client_tokens": clients.tokens_per_process,
        "first_errors": result.errors[:3],
    }


def cmd_tokens(args) -> None:
    mesh = SimMesh(
        args.prefill,
        args.decode,
        args.token_rate,
        args.router_arg,
        args.router_tree,
        args.worker_processes,
        feeds=not args.no_feed,
    )
    rows = []
    try:
        mesh.wait_ready()
        for api in args.api.split(","):
            rows.append(
                measure_tokens(
                    mesh, api, args.concurrency, args.duration, args.max_tokens, args.py_spy, args.client_processes
                )
                | {"sim_feed": not args.no_feed, "router_tree": args.router_tree or "."}
            )
            print_table(
                rows[-1:],
                [
                    "api",
                    "sim_feed",
                    "concurrency",
                    "worker_processes",
                    "client_processes",
                    "tokens",
                    "errors",
                    "wrong_streams",
                    "tokens_per_s",
                    "router_cpu_us_per_token",
                    "router_core_share",
                    "sim_workers_cores",
                    "client_cores",
                ],
            )
    finally:
        mesh.close()
    warning = busy_warning("router CPU seconds per token are robust to it; tokens/s are not")
    if warning:
        print(warning)
    write_result(args.out or RESULTS / "router_sim_tokens.json", {"rows": rows, "warning": warning})


def control_traffic(worker_logs: list[Path]) -> dict:
    """Per second, between each simulated workers' process's last two SIM_CONTROL lines, summed over the processes:
    registration calls and their payload bytes (request + reply messages, without HTTP/2 framing), report messages
    and their payload bytes."""
    names = ("calls", "bytes", "reports", "report_bytes")
    total = dict.fromkeys(names, 0.0)
    for log in worker_logs:
        lines = [line.split()[1:] for line in log.read_text().splitlines() if line.startswith("SIM_")]
        samples = [dict(kv.split("=") for kv in line) for line in lines if line and "=" in line[0]]
        if len(samples) < 2:
            return {}  # a process not yet sampled twice: a partial sum would understate the traffic
        a, b = samples[-2], samples[-1]
        dt = float(b["seconds"]) - float(a["seconds"])
        for name in names:
            total[name] += (float(b[name]) - float(a[name])) / dt
    return {f"{name}_per_s": round(total[name], 1) for name in names}


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
        router_args = ["--api-server-count", str(n), *args.router_arg]
        mesh = SimMesh(args.prefill, args.decode, args.token_rate, router_args, None, args.worker_processes)
        try:
            mesh.wait_ready(args.ready_timeout)
            row = {"processes": n, "workers": args.prefill + args.decode}
            row.update(worker_processes=args.worker_processes, client_processes=args.client_processes)
            row["all_healthy_s"] = round(time.monotonic() - started, 1)
            time.sleep(args.idle)  # settled: every stream past its first report
            cpu0 = mesh.router_cpu()
            time.sleep(args.idle)
            row["idle_router_cores"] = round((mesh.router_cpu() - cpu0) / args.idle, 3)
            row.update(control_traffic(mesh.worker_logs))
            row["idle_rss_mib"] = rss_mib(tree_pids(mesh.router.pid))
            load = measure_tokens(
                mesh, "grpc", args.concurrency, args.duration, args.max_tokens, client_processes=args.client_processes
            )
            row["loaded_rss_mib"] = rss_mib(tree_pids(mesh.router.pid))
            row["tokens_per_s"] = load["tokens_per_s"]
            row["tokens_per_s_per_process"] = round(load["tokens_per_s"] / n, 1)
            row["router_cpu_us_per_token"] = load["router_cpu_us_per_token"]
            row["router_cores"] = load["router_core_share"]
            row["sim_workers_cores"], row["client_cores"] = load["sim_workers_cores"], load["client_cores"]
            row["errors"], row["wrong_streams"] = load["errors"], load["wrong_streams"]
            rows.append(row)
            print_table([row], list(row))
        finally:
            mesh.close()
        # after each row: a run cut short by its time bound (scripts/gpu_stage.sh) keeps the rows it finished
        warning = busy_warning("every figure here is bounded by the machine, not the router")
        write_result(args.out or RESULTS / "router_sim_mesh.json", {"rows": rows, "warning": warning})
    if warning:
        print(warning)


def cmd_index(args) -> None:
    from bench.sim_index import run_index

    row = run_index(args.workers, args.keys, args.prompt_tokens, args.decisions)
    print_table([row], list(row))
    warning = busy_warning("the microsecond figures are upper bounds")
    if warning:
        print(warning)
    write_result(args.out or RESULTS / "router_sim_index.json", {"rows": [row], "warning": warning})


def add_process_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-processes", type=int, default=1, help="processes the simulated workers are spread over"
    )
    parser.add_argument(
        "--client-processes", type=int, default=1, help="processes of the load generator, each at concurrency / C"
    )


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
    t.add_argument(
        "--no-feed", action="store_true", help="simulated decode workers without the token feed (per-request streams)"
    )
    t.add_argument("--py-spy", help="sample the router with py-spy (on PATH) into PREFIX.<api>.<pid>.txt")
    add_process_options(t)
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
    add_process_options(m)
    m.add_argument("--out")
    i = sub.add_parser("index", help="prefix index size and lookup cost, routing decision latency (in process)")
    i.add_argument("--workers", type=int, default=1000)
    i.add_argument("--keys", type=int, default=10_000, help="cached-prefix keys each worker reports")
    i.add_argument("--prompt-tokens", type=int, default=2048)
    i.add_argument("--decisions", type=int, default=2000)
    i.add_argument("--out")
    args = p.parse_args()
    exit_on_sigterm()
    {"tokens": cmd_tokens, "mesh": cmd_mesh, "index": cmd_index}[args.command](args)


if __name__ == "__main__":
    main()

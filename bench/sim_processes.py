"""The router simulation (bench/router_sim.py) spread over processes, so that the simulation, not the router, has
cores to spare: each process's share of the simulated workers or of the concurrent streams, the load generator run in
several processes (each one asyncio thread, as bench/sim_load.run_load is), and their results merged into one.

A load process is started by the driver and runs as

    python bench/sim_processes.py --api grpc --target 127.0.0.1:50051 --concurrency 16 --duration 20 --max-tokens 128

It prints `SIM_CLIENT_READY` once imported and connected to nothing yet, starts its streams when a line comes on its
stdin (so that every process starts together, after the driver has read the router's CPU), and prints
`SIM_CLIENT_RESULT <json>` (a LoadResult) at the end."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, stop_group
from bench.sim_load import LoadResult, run_load

READY, RESULT = "SIM_CLIENT_READY", "SIM_CLIENT_RESULT"
READY_TIMEOUT_S = 120.0  # a load process's start: the interpreter, grpc and the stubs imported on a busy machine


def shares(total: int, parts: int) -> list[int]:
    """`total` spread over `parts` as evenly as whole numbers allow, the first parts taking the remainder."""
    if parts < 1:
        raise ValueError(f"at least one part, not {parts}")
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def merge_results(results: list[LoadResult]) -> LoadResult:
    """The load of several processes that ran side by side as one: streams, tokens, wrong streams, errors and CPU
    summed; the seconds are the longest process's (they ran at the same time, so tokens / seconds is the rate of
    all of them together, not the sum of their runs' lengths)."""
    return LoadResult(
        streams=sum(r.streams for r in results),
        tokens=sum(r.tokens for r in results),
        errors=[e for r in results for e in r.errors],
        wrong=sum(r.wrong for r in results),
        seconds=max((r.seconds for r in results), default=0.0),
        cpu_s=sum(r.cpu_s for r in results),
    )


class LoadClients:
    """The load generator in `processes` processes, each at its share of `concurrency`; one process means in this
    one (as before there were several). Started (and ready) when constructed; `run()` streams and returns the
    merged result."""

    def __init__(
        self, api: str, target: str, concurrency: int, duration: float, max_tokens: int, processes: int, logs: Path
    ):
        self.load = (api, target, concurrency, duration, max_tokens)
        self.procs: list[subprocess.Popen] = []
        self.tokens_per_process: list[int] = []  # after run(): how evenly the processes streamed
        if processes == 1:
            return
        try:
            for i, share in enumerate(s for s in shares(concurrency, processes) if s):
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(Path(__file__).resolve()), "--api", api, "--target", target]
                        + ["--concurrency", str(share), "--duration", str(duration), "--max-tokens", str(max_tokens)]
                        + ["--seed", str(i)],
                        cwd=ROOT,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=(logs / f"client-{i}.log").open("w"),
                        text=True,
                        start_new_session=True,
                    )
                )
            for i, proc in enumerate(self.procs):
                line = _read_line(proc, READY_TIMEOUT_S)
                if line.strip() != READY:
                    raise RuntimeError(f"load process {i} did not start: {line!r} (see {logs / f'client-{i}.log'})")
        except BaseException:
            self.close()
            raise

    def run(self) -> LoadResult:
        if not self.procs:
            result = asyncio.run(run_load(*self.load))
            self.tokens_per_process = [result.tokens]
            return result
        try:
            for proc in self.procs:  # together: each waits for this line
                proc.stdin.write("go\n")
                proc.stdin.flush()
            results = []
            for i, proc in enumerate(self.procs):
                out, _ = proc.communicate(timeout=self.load[3] + 660)  # the run, then its last streams' timeout
                found = [line for line in out.splitlines() if line.startswith(RESULT)]
                if not found:
                    raise RuntimeError(f"load process {i} gave no result (exit {proc.returncode})")
                results.append(LoadResult(**json.loads(found[-1][len(RESULT) :])))
            self.tokens_per_process = [r.tokens for r in results]
            return merge_results(results)
        finally:
            self.close()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                stop_group(proc, timeout=5)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line, or '' if it gives none within `timeout` (a hung start must not hang the run)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return ""
    return proc.stdout.readline()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=("grpc", "rest"), required=True)
    p.add_argument("--target", required=True, help="host:port (grpc) or the base URL (rest)")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=0, help="of the prompts (each process its own)")
    args = p.parse_args()
    print(READY, flush=True)
    if not sys.stdin.readline():
        return  # the driver went away before the start
    result = asyncio.run(
        run_load(args.api, args.target, args.concurrency, args.duration, args.max_tokens, seed=args.seed)
    )
    print(RESULT, json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    main()

"""Load and soak against a running mesh (gRPC, streaming), bounded in count and time, loopback only.

    python bench/load_soak.py burst --concurrency 500 --max-tokens 8
    python bench/load_soak.py soak --duration 600 --rate 4 --out bench/results/soak_cpu.json

`burst` sends N streaming requests at once and counts errors. `soak` sends requests at a steady rate for a
duration and reports the resident memory (RSS) of every mesh process at the start and the end. Without
--address both start their own mesh (`deltamesh serve`) on free ports and stop it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, free_port, stop_group, write_result
from deltamesh.client import AsyncClient, DeltameshError
from deltamesh.services.router.control import read_loads


class OwnMesh:
    """`deltamesh serve` in a child process group, for runs that need RSS of every process."""

    def __init__(self, extra: list[str]):
        self.port, self.control_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.secret = secrets.token_hex(16)  # given to the mesh, so that its loads can be read here
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deltamesh.services.cli",
                "serve",
                "--grpc-port",
                str(self.port),
                "--control-port",
                str(self.control_port),
                "--http-port",
                "0",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=ROOT,
            env={**os.environ, "DELTAMESH_MESH_SECRET": self.secret},
        )

    def wait_ready(self, workers: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if sum(w.healthy for w in read_loads(f"127.0.0.1:{self.control_port}", self.secret)) >= workers:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise TimeoutError("mesh did not become ready")

    def pids(self) -> list[int]:
        """The serve process and all its descendants."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def stop(self) -> None:
        stop_group(self.proc, timeout=20)


def rss_by_process(pids: list[int]) -> dict[str, float]:
    """{'pid role': RSS in MiB}."""
    out = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        roles = ("serve", "router", "prefill", "decode", "colocated")
        role = next((c.decode() for c in cmd if c.decode() in roles), "?")
        kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        out[f"{pid} {role}"] = round(kib / 1024, 1)
    return out


async def one_request(client: AsyncClient, rng: random.Random, max_tokens: int, timeout: float) -> str:
    prompt = [rng.randrange(10, 3000) for _ in range(rng.randint(4, 64))]
    tokens = 0
    try:
        stream = client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=timeout)
        async for delta in stream:
            tokens += len(delta.token_ids)
    except DeltameshError as e:
        return f"error: {e.code.name}"
    return "ok" if tokens == max_tokens else f"short: {tokens}"


async def burst(address: str, concurrency: int, max_tokens: int, timeout: float, seed: int) -> dict:
    rng = random.Random(seed)
    started = time.monotonic()
    async with AsyncClient(address, retries=0) as client:
        outcomes = await asyncio.gather(*(one_request(client, rng, max_tokens, timeout) for _ in range(concurrency)))
    return _summary(outcomes, started)


async def soak(address: str, duration: float, rate: float, max_tokens: int, timeout: float, seed: int) -> dict:
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    started = time.monotonic()
    async with AsyncClient(address, retries=0) as client:
        while time.monotonic() - started < duration:
            tasks.append(asyncio.create_task(one_request(client, rng, max_tokens, timeout)))
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
    return _summary(outcomes, started)


def _summary(outcomes: list[str], started: float) -> dict:
    """Requests, their outcomes counted, errors (every outcome but "ok") and the seconds since `started`."""
    counts = dict(Counter(outcomes))
    return {
        "requests": len(outcomes),
        "outcomes": counts,
        "errors": len(outcomes) - counts.get("ok", 0),
        "seconds": round(time.monotonic() - started, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["burst", "soak"])
    p.add_argument("--address", help="router gRPC address (default: start a mesh)")
    p.add_argument("--concurrency", type=int, default=500, help="burst: requests at once")
    p.add_argument("--duration", type=float, default=600, help="soak: seconds")
    p.add_argument("--rate", type=float, default=4.0, help="soak: requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="per-request deadline (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="--max-num-seqs 64", help="extra `deltamesh serve` flags")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    mesh = None if args.address else OwnMesh(args.serve_args.split())
    try:
        if mesh:
            mesh.wait_ready(workers=2)
        address = args.address or mesh.address
        asyncio.run(burst(address, 16, args.max_tokens, args.timeout, args.seed + 1))  # warm-up, not counted
        rss_start = rss_by_process(mesh.pids()) if mesh else {}
        if args.mode == "burst":
            result = asyncio.run(burst(address, args.concurrency, args.max_tokens, args.timeout, args.seed))
        else:
            result = asyncio.run(soak(address, args.duration, args.rate, args.max_tokens, args.timeout, args.seed))
        rss_end = rss_by_process(mesh.pids()) if mesh else {}
    finally:
        if mesh:
            mesh.stop()
    result |= {"mode": args.mode, "rss_mib_start": rss_start, "rss_mib_end": rss_end}
    print(
        f"{args.mode}: {result['requests']} requests in {result['seconds']}s, errors {result['errors']}, "
        f"outcomes {result['outcomes']}"
    )
    if rss_start:
        print(f"{'process':<22}{'RSS start MiB':>15}{'RSS end MiB':>13}")
        for key in rss_start:
            print(f"{key:<22}{rss_start[key]:>15}{rss_end.get(key, float('nan')):>13}")
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

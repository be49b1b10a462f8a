"""What a serving point looks like from inside the server: each server process's CPU use (a process near 100 % of
a core is where a stream waits) and the mean time to first token as the router, the workers' servicers and their
engines saw it, and the engines' mean queue time (arrival to first scheduled step). Against the client's mean TTFT:
client minus router is the REST gateway and the client, router minus worker the router's own legs, worker minus
engine the worker's event loop, engine minus queue the prefill steps and the first token's way to the host."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each live process in process group `pgid`, by a short name: its
    `deltamesh.services.cli` subcommand (router, colocated, ...), else the executable's name; with its pid."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) != pgid:
            continue
        args = [a.decode(errors="replace") for a in cmd if a]
        name = (
            args[args.index("deltamesh.services.cli") + 1]
            if "deltamesh.services.cli" in args[:-1]
            else Path(args[0]).name
            if args
            else "?"
        )
        out[f"{name}[{pid}]"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def metrics_urls(serve_log: Path) -> list[str]:
    """The workers' /metrics URLs that `deltamesh serve` printed in its log."""
    text = serve_log.read_text(errors="replace") if serve_log.is_file() else ""
    line = next((ln for ln in text.splitlines() if "metrics:" in ln and ln.startswith("deltamesh: router")), "")
    return re.findall(r"http://\S+/metrics", line)


# latency families whose mean a point reports, by the end of their name: (suffix, short name)
_LATENCIES = (
    ("time_to_first_token_seconds", "ttft"),
    ("request_queue_seconds", "queue"),
    ("request_queue_time_seconds", "queue"),
)


def latency_totals(urls: list[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each latency histogram or summary in _LATENCIES at these /metrics URLs, by a short name:
    where it is measured (router, worker, engine; vllm) and what (ttft, queue)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = {}
    for url in urls:
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            what = next((short for suffix, short in _LATENCIES if family.name.endswith(suffix)), None)
            if what is None:
                continue
            where = family.name.split(":")[0] if ":" in family.name else family.name.split("_")[1]
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")):
                    totals.setdefault(f"{where}_{what}", [0.0, 0.0])[s.name.endswith("_count")] += s.value
    return {k: (v[0], v[1]) for k, v in totals.items()}


class PointObserver:
    """Around one load point: `start()`, run it, then `finish()` gives the server side's figures."""

    def __init__(self, pgid: int, urls: list[str]):
        self.pgid, self.urls = pgid, urls

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = group_cpu_seconds(self.pgid)
        self.latency0 = latency_totals(self.urls)

    def finish(self) -> dict:
        wall = time.monotonic() - self.t0
        cpu = group_cpu_seconds(self.pgid)
        out = {
            "cpu_pct": {
                k: round(100 * (v - self.cpu0.get(k, 0.0)) / wall, 1)
                for k, v in cpu.items()
                if v - self.cpu0.get(k, 0.0) > 0.01 * wall
            }
        }
        for name, (s, n) in latency_totals(self.urls).items():
            s0, n0 = self.latency0.get(name, (0.0, 0.0))
            if n > n0:
                out[f"{name}_mean_ms"] = round(1000 * (s - s0) / (n - n0), 1)
        return out

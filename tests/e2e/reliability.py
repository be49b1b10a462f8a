"""Collects what the fault suite measured and renders docs/RELIABILITY.md's table.

Rows are written at the end of the session: to docs/RELIABILITY.md when DELTAMESH_RELIABILITY_OUT says so
(`make reliability`), otherwise next to the test logs."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Row:
    fault: str
    expected: str
    test: str
    measured: str


ROWS: list[Row] = []


def record(fault: str, expected: str, test: str, measured: str) -> None:
    ROWS.append(Row(fault, expected, test, measured))


def render() -> str:
    lines = [
        "# Reliability: faults and what the mesh does about them",
        "",
        "Produced by the fault-injection suite (`make reliability`, i.e. `pytest -m fault` with",
        "`DELTAMESH_RELIABILITY_OUT=docs/RELIABILITY.md`): real router, prefill and decode processes on loopback,",
        "faults injected with signals or failpoints. After every fault the suite checks that each surviving",
        "worker's pages, slots, leases and reservations return to zero (GetLoads) and that no request outlives",
        "its deadline. Times are wall-clock on the machine below; they are measurements, not limits.",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} on "
        f"{platform.machine()} with {os.cpu_count()} CPU cores ({platform.platform()}).",
        "",
        "| fault | expected behaviour | test | measured |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r.fault} | {r.expected} | `{r.test}` | {r.measured} |" for r in ROWS]
    lines += [
        "",
        "Known limits:",
        "- A posted UCX read cannot be cancelled. When a pull hits its deadline or is cancelled, the decode",
        "  worker sends the holder an abandon notice (the holder frees the held state at once) and gives the",
        "  reserved pages back once its posted reads are done, so a late write cannot reach pages another",
        "  request uses. Reads that need the holder's help (RMA over TCP, the CPU default) wait for a stopped",
        "  holder; then the pages come back one more transfer deadline later.",
        "- With `--no-ucx-error-handling` (shared memory / cuda_ipc) UCX cannot report a dead peer; the pull",
        "  deadline and the gRPC legs still end every request in bounded time. Reads there are one-sided (CMA,",
        "  cuda_ipc): a pull from a stopped (not dead) prefill worker completes, and its done notice waits.",
    ]
    return "\n".join(lines) + "\n"


def write(default_dir: Path) -> Path | None:
    if not ROWS:
        return None
    out = Path(os.environ.get("DELTAMESH_RELIABILITY_OUT") or default_dir / "RELIABILITY.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    return out

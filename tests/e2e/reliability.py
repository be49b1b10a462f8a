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
        "Produced by the fault-injection and attack suites (`make reliability`, i.e. `pytest -m 'fault or security'`",
        "with `DELTAMESH_RELIABILITY_OUT=docs/RELIABILITY.md`): real router, prefill and decode processes on loopback,",
        "faults injected with signals or failpoints, attacks sent as a hostile client would (the security review's,",
        "each tried again). After every fault the suite checks that each surviving",
        "worker's pages, slots, leases and reservations return to zero (GetLoads) and that no request outlives",
        "its deadline. Times are wall-clock on the machine below; they are measurements, not limits.",
        "",
        f"Generated {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')} on "
        f"{platform.machine()} with {os.cpu_count()} CPU cores ({platform.platform()}).",
        "",
        "| fault | expected behaviour | test | measured |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r.fault} | {r.expected} | `{r.test}` | {r.measured} |" for r in ROWS]
    lines += [
        "",
        "Threat model:",
        "- Clients are untrusted. They reach only the router's client API (gRPC `Generate`, `Abort` with the",
        "  request's abort token, `ListModels`, health; REST `/v1`), guarded by `--api-key` on both when set (give it",
        "  with `--api-key-file` or `DELTAMESH_API_KEY`: a command line is visible to every local user). An abort token",
        "  is bound to one run of a request (a nonce the router holds while it runs), so a token kept from an earlier",
        "  request with the same id aborts nothing. Both edges apply one set of limits (`deltamesh/services/router/",
        "  limits.py`: request ids of 1-128 printable ASCII characters, 4 MiB per request, stop strings, counts of",
        "  prompts, choices and messages) before any tokenising, and tokenising runs off the router's event loop. A",
        "  request's choices enter the mesh in turn (`--max-prefilling-tokens`, `--max-running-choices`), so one",
        "  request of many prompts delays another client's first token by about one engine step's prefill, not by",
        "  the whole batch. HTTP clients have `--http-header-timeout` for their headers and `--http-body-timeout` for",
        "  their body. Errors tell clients what failed, never where: worker addresses and details go to the log.",
        "- Fairness is per request, not per client: behind one API key or one proxy the router cannot tell clients",
        "  apart, and a client that opens many requests at once is as much load as as many clients (bounded by the",
        "  workers' admission: a full mesh answers 429 / RESOURCE_EXHAUSTED after `--admission-timeout`).",
        "- The router and the workers of one mesh trust each other. Every call between them carries the mesh secret",
        "  (`deltamesh serve` makes one per mesh; `DELTAMESH_MESH_SECRET` / `--mesh-secret-file` otherwise): the",
        "  router's control plane (its own listener, `--control-port`) and every worker port refuse calls without it,",
        "  health checks excepted. The secret is a bearer value: off one host, run the mesh's gRPC over TLS. A secret",
        "  or API key file that its group or others may write is refused at start.",
        "- The side channel (UCX) is neither encrypted nor authenticated. A pool's remote key lets its holder read the",
        "  whole registered pool, as in vLLM's and SGLang's RMA transfers; keys and UCX addresses travel only over",
        "  the authenticated gRPC calls, so they reach the mesh's own workers only. Within that trust boundary a lease",
        "  is bound to its token and its exact regions (the lease word is a MAC of both), ends only with its token,",
        "  is pulled once (the done notice ends it; a second pull racing the notice's flight would also validate), and",
        "  lives at most `--max-lease-ttl`.",
        "- Workers' Prometheus ports (`--metrics-port`) are unauthenticated and show loads only; keep them on",
        "  loopback or a trusted network.",
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

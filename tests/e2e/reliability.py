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
        "- The side channel (UCX) has no authentication or encryption of its own, and UCX serves a peer's software",
        "  RMA (its fallback on transports without RMA in hardware: TCP, shared-memory queues) by copying from or to",
        "  any address the peer names, with no check of a remote key: whoever reaches a worker's UCX can read or",
        "  write its whole memory, or crash it. So who can reach it at all is the boundary",
        "  (docs/notes/side-channel-security.md):",
        "  - One host (the default): the workers open shared memory (its file passed through /proc/<pid>/fd), CMA and",
        "    CUDA IPC only, no network transport and so no listening socket (`ss -ltnp`: their gRPC and metrics",
        "    ports). The kernel lets only the workers' own user (and root) open that shared memory or read by CMA:",
        "    every process of that user on the host is a member, as it could ptrace the workers anyway; run the mesh",
        "    as a user of its own. Reads are one-sided (the reader's CMA syscall, a CUDA copy): a bad address fails",
        "    in the reader.",
        "  - Across hosts (`--side-channel-interface IFACE`): UCX also speaks TCP on IFACE, and TCP carries RMA in",
        "    software: anyone who can connect to a worker's UCX port there can read and write the worker's memory.",
        "    UCX cannot refuse an endpoint by who opens it (a worker address needs no listener's consent), so the",
        "    network must: IFACE must be a network only the mesh's hosts reach (a private VLAN or network namespace,",
        "    or firewall rules admitting only the mesh's hosts to the UCX ports, which `UCX_TCP_PORT_RANGE` pins).",
        "    RDMA checks remote keys in hardware for its own RMA, but its message lanes still answer software RMA:",
        "    the same rule holds there.",
        "- Within the mesh a lease is bound to its token, its exact regions (the lease word is a MAC of both) and its",
        "  holder. The router announces every worker that holds state, static or registered, in its load polls",
        "  (prefill workers to decode workers, decode workers' prefix offers to prefill workers), and a puller",
        "  refuses the lease of a holder not announced to it; a region must be in the worker the word is read from",
        "  or in a rank that worker announced, and the word among the lease words it announced, or the pull is",
        "  refused before any byte moves. No worker may claim another's side-channel memory: the router refuses a",
        "  worker whose description names a UCX worker another worker's names (never healthy, announced to no",
        "  one), and each puller keeps the first claim. The first claim wins: after a router restart an insider",
        "  who kept a worker's UCX address and registers before it is recorded first (pullers that heard the real",
        "  worker before still refuse it). A lease ends only with its token, is pulled once (the done notice ends",
        "  it; a second pull racing the notice's flight would also validate), and lives at most `--max-lease-ttl`.",
        "  A member's process can do what any UCX peer can: ask for software RMA at any address (at an unmapped one",
        "  the worker crashes).",
        "- Workers' Prometheus ports (`--metrics-port`) are unauthenticated and show loads only; keep them on",
        "  loopback or a trusted network.",
        "",
        "Known limits:",
        "- A posted UCX read cannot be cancelled. When a pull hits its deadline or is cancelled, the decode",
        "  worker sends the holder an abandon notice (the holder frees the held state at once) and gives the",
        "  reserved pages back once its posted reads are done, so a late write cannot reach pages another",
        "  request uses. Reads that need the holder's help (RMA over TCP, across hosts) wait for a stopped",
        "  holder; then the pages come back one more transfer deadline later.",
        "- Over TCP (across hosts) UCX serves reads by having the holder send the bytes back. If the reading decode",
        "  worker dies while the prefill worker sends such a reply, UCX 1.21 aborts the prefill worker",
        '  (`ucp_request.inl` "Fatal: unexpected error: Endpoint timeout": its reply path treats a failed send as',
        "  fatal, openucx/ucx#7274); `deltamesh serve` restarts it and its requests end UNAVAILABLE. Reads on one host",
        "  (CMA, cuda_ipc) are one-sided and have no reply path.",
        "- With `--no-ucx-error-handling` UCX cannot report a dead peer; the pull deadline and the gRPC legs still end",
        "  every request in bounded time. UCX then also treats a failed read as fatal: a descriptor naming an address",
        "  the holder does not map (only a member can hand one over) aborts the reading worker.",
    ]
    return "\n".join(lines) + "\n"


def write(default_dir: Path) -> Path | None:
    if not ROWS:
        return None
    out = Path(os.environ.get("DELTAMESH_RELIABILITY_OUT") or default_dir / "RELIABILITY.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    return out

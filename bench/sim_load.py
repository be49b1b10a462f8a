"""Streaming load for the router simulation (bench/router_sim.py): many concurrent streams through a router's gRPC
client API or its REST gateway, each stream's tokens checked against what the simulated workers send
(bench/sim_workers.py), and the router's CPU seconds over the run read from /proc.

The gRPC streams go over several channels, each its own connection (a local subchannel pool): a router of several
processes sharing the port (SO_REUSEPORT) spreads connections, not calls, over its processes."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc

_ids = itertools.count()


@dataclass
class LoadResult:
    streams: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    wrong: int = 0  # streams whose tokens were not the simulated workers' (bench/sim_workers.token)
    seconds: float = 0.0
    cpu_s: float = 0.0  # the load generator's own CPU over the run: is the client, not the router, the bound?


def process_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds so far of these processes (gone ones count 0)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def tree_pids(root: int) -> list[int]:
    """`root` and its live descendants (a router of several processes starts each in a process group of its own)."""
    parents: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[int(pid)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _prompt(rng: random.Random, prompt_len: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(prompt_len)]


def _expected(prompt_len: int, max_tokens: int) -> list[int]:
    return [(prompt_len + i) % 1000 for i in range(max_tokens)]


async def _grpc_stream(stub, prompt: list[int], max_tokens: int, result: LoadResult, check: bool) -> None:
    request = router_pb2.GenerateRequest(
        request_id=f"sim-{os.getpid()}-{next(_ids)}",
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
    )
    got: list[int] = []
    try:
        async for reply in stub.Generate(request, timeout=600):
            got.extend(reply.delta.token_ids)
    except grpc.aio.AioRpcError as e:
        result.errors.append(f"{e.code().name}: {e.details()}")
        return
    result.streams += 1
    result.tokens += len(got)
    if check and got != _expected(len(prompt), max_tokens):
        result.wrong += 1


async def _rest_stream(client, url: str, prompt: list[int], max_tokens: int, result: LoadResult, check: bool) -> None:
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    texts: list[str] = []
    async with client.stream("POST", url, json=body, timeout=600) as response:
        if response.status_code != 200:
            result.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            return
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.errors.append(str(chunk["error"])[:200])
                    return
                texts.extend(c["text"] for c in chunk["choices"])
    tokens = "".join(texts).split()
    result.streams += 1
    result.tokens += len(tokens)
    if check and tokens != [f"t{t}" for t in _expected(len(prompt), max_tokens)]:
        result.wrong += 1


async def run_load(
    api: str,
    target: str,
    concurrency: int,
    duration_s: float,
    max_tokens: int,
    prompt_len: int = 32,
    channels: int = 8,
    check: bool = True,
    seed: int = 0,
) -> LoadResult:
    """`concurrency` streams at all times for `duration_s` (each stream started then runs to its end): gRPC
    (`api` "grpc", `target` host:port) or REST (`api` "rest", `target` the base URL)."""
    rng, result = random.Random(seed), LoadResult()
    deadline = time.monotonic() + duration_s
    if api == "grpc":
        pool = [
            grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)
        ]
        stubs = [router_pb2_grpc.RouterStub(ch) for ch in pool]

        def one(i: int):
            return _grpc_stream(stubs[i % len(stubs)], _prompt(rng, prompt_len), max_tokens, result, check)
    else:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        client = httpx.AsyncClient(limits=limits)
        url = f"{target}/v1/completions"

        def one(i: int):
            return _rest_stream(client, url, _prompt(rng, prompt_len), max_tokens, result, check)

    async def lane(i: int) -> None:
        while time.monotonic() < deadline:
            await one(i)

    started, cpu0 = time.monotonic(), process_cpu_seconds([os.getpid()])
    await asyncio.gather(*(lane(i) for i in range(concurrency)))
    result.seconds = time.monotonic() - started
    result.cpu_s = process_cpu_seconds([os.getpid()]) - cpu0
    if api == "grpc":
        await asyncio.gather(*(ch.close() for ch in pool))
    else:
        await client.aclose()
    return result

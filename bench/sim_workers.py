"""Simulated workers for the router simulation (bench/router_sim.py): no model, no engine, no side channel.

Each fake worker is a real gRPC server (the mesh secret checked, as a worker checks it) that speaks the workers'
protocol to the router: it registers with the router's control plane, and again while a router process does not
watch it (the workers' own rule: services/common/registration.py), pushes its reports to every router process that
watches it (the workers' own code: services/common/reports.py), and serves its role's calls:

- prefill: `Prefill` answers at once with a first token, a lease and a layout (a pull never comes: the fake decode
  worker does not read it), `ReleaseLease` says yes; its "cache" then holds the prompt (its last whole block's key,
  as a worker's checkpoint at the prompt's end), beside `--cached-blocks` random keys it starts with, the oldest
  evicted past `--cached-blocks` + 1024;
- decode: `Decode` streams the rest of the request's tokens at `--token-rate` tokens/s per stream, one token per
  message, in steps as an engine makes them: every stream of a worker gets its next token at the same moment,
  1 / rate seconds after the last. Token i of a request is (prompt length + i) % 1000, its text " t<id>", so that a
  client can check its stream. A Decode naming a token feed (`Feed`, as the workers serve it: services/decode/
  feed.py) puts its tokens there instead: one message per step for all of the feed's requests. `--no-feed`: Feed is
  UNIMPLEMENTED, as on a worker from before it (the router then streams each request on its own).

Run as a process of its own (the driver starts it):

    python bench/sim_workers.py --router 127.0.0.1:50052 --prefill 500 --decode 500 --token-rate 50

and it prints one line `SIM_WORKERS_READY <n>` once every worker listens. The mesh secret comes from
$DELTAMESH_MESH_SECRET as for real workers. Several such processes can serve one simulation (router_sim's
--worker-processes): each worker listens on a port the kernel picks (from the ephemeral range, which the router's
ports, from bench.common.free_port, lie below), so no two collide."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltamesh.protocol.blocks import block_keys
from deltamesh.services.common.auth import MESH_SECRET_ENV, mesh_interceptor, mesh_metadata
from deltamesh.services.common.registration import RegistrationPace
from deltamesh.services.common.reports import ReportSource, ReportsServicer, Watchers
from deltamesh.services.common.server import SERVER_OPTIONS
from deltamesh.v1 import (
    common_pb2,
    control_pb2,
    control_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

MODEL = "deltamesh-tiny"  # what the fake workers register as serving (the router's default model)
SLOTS, PAGES = 256, 1 << 16  # what a fake worker reports as its pools: room enough for any simulated load
PAGE = 16  # the block size the fake caches name prompts by (the router's default --page-size)


def token(prompt_len: int, i: int) -> int:
    """The i-th generated token of a request whose prompt has `prompt_len` tokens (the first token is i = 0)."""
    return (prompt_len + i) % 1000


class FakeWorker:
    """One simulated worker's state: what it reports as its load and its cache."""

    def __init__(self, role: str, cached_blocks: int = 0, seed: int = 0):
        self.role, self.address = role, ""
        self.watchers = Watchers()  # the router processes watching it
        self.running = 0
        rng = random.Random(seed)
        self.cache: OrderedDict[int, None] = OrderedDict((rng.getrandbits(63), None) for _ in range(cached_blocks))
        self.max_cached = cached_blocks + 1024

    def keys(self) -> set[int]:
        return set(self.cache)

    def cache_prompt(self, ids) -> None:
        keys = block_keys(ids, PAGE)
        if keys:
            self.cache[keys[-1]] = None
            self.cache.move_to_end(keys[-1])
            while len(self.cache) > self.max_cached:
                self.cache.popitem(last=False)

    def load(self) -> common_pb2.WorkerLoad:
        return common_pb2.WorkerLoad(
            address=self.address,
            role=self.role,
            running=self.running,
            kv_pages_total=PAGES,
            state_slots_total=SLOTS,
            healthy=True,
            prefix_cache=True,
        )

    async def GetLoads(self, request, context):
        return common_pb2.GetLoadsResponse(workers=[self.load()])


class FakePrefill(FakeWorker, prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cached_blocks: int = 0, seed: int = 0):
        super().__init__("prefill", cached_blocks, seed)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context):
        n = len(request.prompt_token_ids)
        self.cache_prompt(request.prompt_token_ids)
        first = common_pb2.TokenDelta(
            token_ids=[token(n, 0)],
            text=f" t{token(n, 0)}",
            usage=common_pb2.Usage(prompt_tokens=n, completion_tokens=1),
        )
        if request.sampling.max_tokens <= 1:
            first.finished, first.finish_reason = True, common_pb2.FINISH_REASON_LENGTH
            return prefill_pb2.PrefillResponse(first=first)
        return prefill_pb2.PrefillResponse(
            first=first,
            lease=common_pb2.Lease(lease_id=request.request_id, token=request.lease_token),
            layout=common_pb2.StateLayout(compat_hash="sim", num_tokens=n),
            transport=common_pb2.TransportDescriptor(kind="sim", version=1),
        )

    async def ReleaseLease(self, request, context):
        return common_pb2.LeaseResponse(ok=True)


class Steps:
    """An engine's steps: whoever waits gets woken with everyone else at the next step, `interval` after the last."""

    def __init__(self, interval: float):
        self.interval = interval
        self._next: asyncio.Future | None = None

    async def next(self) -> None:
        if self._next is None or self._next.done():
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            loop.call_later(self.interval, self._next.set_result, None)
        await asyncio.shield(self._next)


class FakeFeed:
    """A token feed (decode.proto `Feed`) as the workers' own (services/decode/feed.py) serves it: the deltas ready
    at a step, one message for all of the feed's requests; a request's deltas not yet written merge into one."""

    def __init__(self):
        self.pending: dict[int, common_pb2.TokenDelta] = {}
        self.ready = asyncio.Event()
        self.written: dict[int, asyncio.Future] = {}  # a request's, set once its final delta is written
        self.closed = False

    def put(self, key: int, delta: common_pb2.TokenDelta) -> None:
        waiting = self.pending.get(key)
        if waiting is None:
            self.pending[key] = delta
        else:
            waiting.token_ids.extend(delta.token_ids)
            waiting.text += delta.text
            waiting.finished, waiting.finish_reason = delta.finished, delta.finish_reason
            waiting.usage.CopyFrom(delta.usage)
        self.ready.set()

    async def messages(self):
        yield decode_pb2.FeedBatch()
        while True:
            await self.ready.wait()
            self.ready.clear()
            batch = decode_pb2.FeedBatch(deltas=[decode_pb2.FeedDelta(key=k, delta=d) for k, d in self.pending.items()])
            ended = [k for k, d in self.pending.items() if d.finished]
            self.pending.clear()
            yield batch
            for k in ended:
                if (f := self.written.get(k)) is not None and not f.done():
                    f.set_result(True)

    def close(self) -> None:
        self.closed = True
        for f in self.written.values():
            if not f.done():
                f.set_result(False)


class FakeDecode(FakeWorker, decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, token_rate: float, feeds: bool = True):
        """`feeds`: serves the token feed (else Feed is UNIMPLEMENTED, as on a worker from before it)."""
        super().__init__("decode")
        self.steps = Steps(1.0 / token_rate)
        self.feeds: dict[str, FakeFeed] | None = {} if feeds else None

    async def Feed(self, request, context):
        if self.feeds is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no token feed here")
        assert self.feeds is not None
        feed = self.feeds[request.feed_id] = FakeFeed()
        try:
            async for batch in feed.messages():
                yield batch
        finally:
            del self.feeds[request.feed_id]
            feed.close()

    async def Decode(self, request, context):
        n, total = len(request.prompt_token_ids), request.sampling.max_tokens or 16
        start = 1 if request.HasField("source") else 0  # the prefill worker sent the first token
        feed = None
        if request.feed_id and self.feeds is not None:
            feed = self.feeds.get(request.feed_id)
            if feed is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "the token feed is not open")
        self.running += 1
        try:
            if feed is not None:
                written = feed.written[request.feed_key] = asyncio.get_running_loop().create_future()
            for i in range(start, total):
                await self.steps.next()
                last = i == total - 1
                delta = common_pb2.TokenDelta(
                    token_ids=[token(n, i)],
                    text=f" t{token(n, i)}",
                    finished=last,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                    usage=common_pb2.Usage(prompt_tokens=n, completion_tokens=i + 1),
                )
                if feed is None:
                    yield delta
                elif feed.closed:
                    break
                else:
                    feed.put(request.feed_key, delta)
            if feed is not None and not await written:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the token feed closed")
        finally:
            self.running -= 1
            if feed is not None:
                feed.written.pop(request.feed_key, None)
                feed.pending.pop(request.feed_key, None)  # cancelled: nothing more of it goes out

    async def ReleaseLease(self, request, context):
        return common_pb2.LeaseResponse(ok=True)


async def serve_one(worker: FakeWorker, host: str, secret: str) -> grpc.aio.Server:
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(mesh_interceptor(secret),))
    add = {"prefill": prefill_pb2_grpc.add_PrefillWorkerServicer_to_server}.get(
        worker.role, decode_pb2_grpc.add_DecodeWorkerServicer_to_server
    )
    add(worker, server)
    reports = CountingReports(ReportSource(worker.load, worker.keys), worker.watchers)
    control_pb2_grpc.add_WorkerReportsServicer_to_server(reports, server)
    port = server.add_insecure_port(f"{host}:0")
    worker.address = f"{host}:{port}"
    await server.start()
    return server


class CountingReports(ReportsServicer):
    """The workers' own report streams, their messages and bytes counted (control-plane traffic)."""

    messages = bytes = 0

    async def Watch(self, request, context):
        async for report in super().Watch(request, context):
            CountingReports.messages += 1
            CountingReports.bytes += report.ByteSize()
            yield report


class Registrar:
    """Keeps every fake worker registered with every process of the router as the workers' own code does (the
    replies name the router's processes; a worker calls a process again while that process does not watch it), the
    workers' calls spread over the interval; counts the calls and their bytes (control-plane traffic)."""

    def __init__(self, router: str, secret: str):
        self.host = router.rsplit(":", 1)[0]
        self.stubs: dict[str, control_pb2_grpc.MeshControlStub] = {}
        self.auth = mesh_metadata(secret)
        self.calls = self.bytes = 0
        self.know(router)

    def know(self, address: str) -> None:
        if address not in self.stubs:
            self.stubs[address] = control_pb2_grpc.MeshControlStub(grpc.aio.insecure_channel(address))

    async def keep(self, worker: FakeWorker, offset: float) -> None:
        request = control_pb2.RegisterWorkerRequest(
            address=worker.address, role=worker.role, model=MODEL, compat_hash="sim"
        )
        await asyncio.sleep(offset)
        paces: dict[str, RegistrationPace] = {}
        while True:
            for address, stub in list(self.stubs.items()):
                pace = paces.setdefault(address, RegistrationPace(worker.watchers))
                if not pace.due():
                    continue
                try:
                    reply = await stub.RegisterWorker(request, metadata=self.auth, timeout=5)
                except grpc.aio.AioRpcError:
                    pace.failed()
                    continue
                pace.registered(reply)
                self.calls += 1
                self.bytes += request.ByteSize() + reply.ByteSize()
                for port in reply.router_control_ports:
                    self.know(f"{self.host}:{port}")
            await asyncio.sleep(min(pace.interval_s for pace in paces.values()))


async def main(args) -> None:
    secret = os.environ[MESH_SECRET_ENV]
    workers: list[FakeWorker] = [FakePrefill(args.cached_blocks, seed=args.seed_base + i) for i in range(args.prefill)]
    workers += [FakeDecode(args.token_rate, feeds=not args.no_feed) for _ in range(args.decode)]
    servers = [await serve_one(w, args.host, secret) for w in workers]
    registrar = Registrar(args.router, secret)
    tasks = [asyncio.create_task(registrar.keep(w, i * 0.5 / len(workers))) for i, w in enumerate(workers)]
    print(f"SIM_WORKERS_READY {len(servers)}", flush=True)
    started = time.monotonic()
    while True:
        await asyncio.sleep(args.report_s)
        seconds = time.monotonic() - started
        print(
            f"SIM_CONTROL calls={registrar.calls} bytes={registrar.bytes} reports={CountingReports.messages} "
            f"report_bytes={CountingReports.bytes} seconds={seconds:.1f}",
            flush=True,
        )
        assert tasks  # the registration loops live as long as this process


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", required=True, help="the router's control-plane address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill", type=int, default=1, help="fake prefill workers")
    p.add_argument("--decode", type=int, default=1, help="fake decode workers")
    p.add_argument("--token-rate", type=float, default=50.0, help="tokens/s of each stream")
    p.add_argument("--no-feed", action="store_true", help="the decode workers serve no token feed (as before #45)")
    p.add_argument("--report-s", type=float, default=5.0, help="seconds between control-traffic lines")
    p.add_argument("--cached-blocks", type=int, default=0, help="random block keys each prefill worker starts with")
    p.add_argument(
        "--seed-base", type=int, default=0, help="first prefill worker's cache seed (each process of workers its own)"
    )
    import uvloop

    uvloop.run(main(p.parse_args()))

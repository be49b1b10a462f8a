"""The mesh view every router process builds for itself (#45): prompt block keys that every process computes alike,
the workers' reports (over real gRPC) into a registry and its prefix index, cache-aware routing read from that
index, and the admission counts the processes of one router share."""

import asyncio
import subprocess
import sys

import grpc
import pytest

from deltamesh.protocol.blocks import block_keys
from deltamesh.services.common.reports import ReportSource, ReportsServicer
from deltamesh.services.router.admission import Admission
from deltamesh.services.router.policies import CacheAware, LeastLoaded
from deltamesh.services.router.prefix_index import PrefixIndex
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.services.router.shared_counts import SharedCounts, create
from deltamesh.v1 import common_pb2, control_pb2_grpc, decode_pb2_grpc

pytestmark = pytest.mark.scale


def test_a_prompts_block_keys_are_the_same_in_every_process():
    ids = list(range(40))
    code = "from deltamesh.protocol.blocks import block_keys; print(block_keys(list(range(40)), 16))"
    other = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in "ab"]
    assert [eval(o.stdout) for o in other] == [block_keys(ids, 16)] * 2
    assert len(block_keys(ids, 16)) == 2  # whole blocks only


def test_the_index_names_each_workers_deepest_resume_point_of_a_prompt():
    keys = block_keys(list(range(64)), 16)  # 4 blocks
    index = PrefixIndex()
    index.add("a", [keys[1]])
    index.add("b", [keys[0], keys[3]])
    index.add("c", [keys[1], 12345])
    assert index.matched(keys) == {"a": 2, "b": 4, "c": 2}
    assert len(index) == 4 and index.entries() == 5
    index.remove("b", [keys[3]])
    assert index.matched(keys) == {"a": 2, "b": 1, "c": 2}
    index.replace("c", [keys[2]])  # a new stream's first report: the whole set
    assert index.matched(keys) == {"a": 2, "b": 1, "c": 3}
    index.forget("a")
    index.forget("b")
    assert index.matched(keys) == {"c": 3}
    assert len(index) == 1 and index.entries() == 1


def test_report_changes_compose_across_samples():
    keys = {1, 2}
    source = ReportSource(lambda: common_pb2.WorkerLoad(), lambda: set(keys))
    first = source.sample(0)
    keys.discard(1)
    keys.add(3)
    source.sample(0)
    keys.add(1)  # evicted, then cached again: no change for a stream that saw the first sample
    keys.discard(3)  # cached, then evicted
    keys.add(4)
    source.sample(0)
    assert source.changes(first.number) == ({4}, set())
    assert source.changes(first.number + 1) == ({1, 4}, {3})
    assert source.sample(60).number == first.number + 2  # fresh enough: not sampled again


def handle(address: str, inflight: int = 0) -> WorkerHandle:
    load = common_pb2.WorkerLoad(address=address, kv_pages_total=100)
    return WorkerHandle(address, "prefill", static=True, channel=None, healthy=True, inflight=inflight, load=load)


def test_cache_aware_follows_what_the_workers_report_not_only_what_it_sent():
    index = PrefixIndex()
    a, b = handle("a"), handle("b")
    prompt = list(range(100, 164))
    index.add("b", [block_keys(prompt, 16)[2]])  # b reported holding 48 of these 64 tokens
    policy = CacheAware(block=16, index=index)
    assert policy.pick([a, b], prompt + [1, 2, 3]) is b
    b.inflight = 20  # too busy: by load, whatever it holds
    assert policy.pick([a, b], prompt + [4, 5]) is a


async def _watched(keys: set[int]):
    server = grpc.aio.server()
    load = common_pb2.WorkerLoad(running=3, kv_pages_total=10)
    control_pb2_grpc.add_WorkerReportsServicer_to_server(
        ReportsServicer(ReportSource(lambda: load, lambda: keys)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _until(condition, timeout: float = 60.0) -> None:
    """Until `condition()`, bounded generously (a loaded machine delays the 20 ms reports)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the bound"
        await asyncio.sleep(0.01)


def test_a_watching_registry_takes_in_loads_and_prefixes_and_drops_a_worker_whose_stream_breaks():
    async def run():
        keys = {11, 22}
        server, address = await _watched(keys)
        registry = WorkerRegistry(0.02, 1.0, "s" * 16)
        stop = asyncio.Event()
        tending = asyncio.create_task(registry.poll_forever(stop))
        w = registry.add(address, "prefill", static=True)
        await _until(lambda: w.healthy and registry.index.keys_of(address) == 2)
        assert w.load.running == 3
        keys.discard(11)
        keys.add(33)
        await _until(lambda: registry.index.matched([33]) == {address: 1} and not registry.index.matched([11]))
        await server.stop(0)  # the worker dies: out of routing at once, its prefixes forgotten
        await _until(lambda: not w.healthy and registry.index.keys_of(address) == 0)
        server, _ = await _restart(address, keys)  # back on its address: watched again, the whole set anew
        await _until(lambda: w.healthy and registry.index.keys_of(address) == 2)
        stop.set()
        await tending
        await registry.close()
        await server.stop(0)

    asyncio.run(run())


async def _restart(address: str, keys: set[int]):
    server = grpc.aio.server()
    load = common_pb2.WorkerLoad()
    control_pb2_grpc.add_WorkerReportsServicer_to_server(
        ReportsServicer(ReportSource(lambda: load, lambda: keys)), server
    )
    assert server.add_insecure_port(address)
    await server.start()
    return server, address


class _Puller(decode_pb2_grpc.DecodeWorkerServicer):
    """A decode worker's GetLoads as far as announcements go: what the router told it."""

    def __init__(self):
        self.told: list[list[bytes]] = []

    async def GetLoads(self, request, context):
        self.told.append([e for h in request.holders for e in h.endpoints])
        return common_pb2.GetLoadsResponse(workers=[common_pb2.WorkerLoad()])


async def _reporting(holder: common_pb2.TransportDescriptor | None, puller: _Puller | None = None):
    server = grpc.aio.server()
    source = ReportSource(lambda: common_pb2.WorkerLoad(), set, lambda: holder)
    control_pb2_grpc.add_WorkerReportsServicer_to_server(ReportsServicer(source), server)
    if puller is not None:
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(puller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_holder_reported_is_announced_to_its_pullers_and_one_claiming_its_endpoint_is_refused():
    """A prefill worker's holder descriptor comes in its reports; the router announces it to the decode worker (a
    GetLoads call carrying it) without being asked, and a second "prefill worker" whose descriptor names the same
    endpoint stays out of routing and out of the announcements."""

    async def run():
        described = common_pb2.TransportDescriptor(kind="ucx", endpoints=[b"P"])
        puller = _Puller()
        servers = [await _reporting(described), await _reporting(None, puller), await _reporting(described)]
        (_, prefill), (_, decode), (_, impostor) = servers
        registry = WorkerRegistry(0.02, 1.0, "s" * 16)
        stop = asyncio.Event()
        tending = asyncio.create_task(registry.poll_forever(stop))
        p, d = registry.add(prefill, "prefill", static=True), registry.add(decode, "decode", static=True)
        await _until(lambda: p.healthy and d.healthy and [b"P"] in puller.told)
        i = registry.add(impostor, "prefill", static=True)
        await _until(lambda: i.refused)
        await asyncio.sleep(0.2)  # ten report intervals
        assert not i.healthy and i.holder is None and all(told == [b"P"] for told in puller.told[1:])
        stop.set()
        await tending
        await registry.close()
        for server, _ in servers:
            await server.stop(0)

    asyncio.run(run())


def test_router_processes_see_each_others_admissions_and_a_restarted_one_starts_from_nothing():
    fd = create(3, capacity=8)
    p0, p1, p2 = (SharedCounts(fd, 3, i, capacity=8) for i in range(3))
    p0.add("10.0.0.1:5000", 1, 40)
    p1.add("10.0.0.1:5000", 2, 10)
    p1.add("10.0.0.2:5000", 1, 7)
    assert p2.others("10.0.0.1:5000") == (3, 50)
    assert p0.others("10.0.0.1:5000") == (2, 10)
    assert p0.others("10.0.0.3:5000") == (0, 0)
    p1.add("10.0.0.1:5000", -2, -10)  # its requests ended
    assert p2.others("10.0.0.1:5000") == (1, 40)
    replaced = SharedCounts(fd, 3, 0, capacity=8)  # process 0 died; the one started in its place
    assert p2.others("10.0.0.1:5000") == (0, 0) and p2.others("10.0.0.2:5000") == (1, 7)
    for i in range(9):  # a row holds `capacity` workers; the process then counts the rest alone
        replaced.add(f"10.1.0.{i}:1", 1, 1)
    assert replaced.full
    assert sum(p1.others(f"10.1.0.{i}:1")[0] for i in range(9)) == 8


def test_router_processes_admit_against_each_others_admissions():
    """Two processes of one router, one decode worker of 2 state slots that has reported nothing in use: each
    process admits one request; a third waits (without the shared counts each process would see a slot free and
    admit it: 3 requests on 2 slots) and enters once the other process's request ends and the worker reports."""

    def process(i: int, fd: int):
        registry = WorkerRegistry(0.5, 1.0, "s" * 32)
        load = common_pb2.WorkerLoad(address="d0", state_slots_total=2, kv_pages_total=1000)
        w = WorkerHandle("d0", "decode", static=True, channel=None, healthy=True, load=load)
        registry.keep(w)
        shared = SharedCounts(fd, 2, i, capacity=8)
        return Admission(registry, LeastLoaded().pick, 8, 30.0, page_size=16, max_model_len=4096, shared=shared), w

    async def run():
        fd = create(2, capacity=8)
        (a, _), (b, wb) = process(0, fd), process(1, fd)
        first = await a.admit(10, 6)
        await b.admit(10, 6)
        third = asyncio.create_task(b.admit(10, 6))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not third.done()
        a.release(first)
        b.on_report(wb)  # the worker's next report (its load unchanged: nothing reached it in this test)
        ticket = await asyncio.wait_for(third, 5)
        assert ticket.worker is wb and wb.admitted == 2

    asyncio.run(run())

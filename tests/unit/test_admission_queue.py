"""The router's admission queue (deltamesh/services/router/admission.py) on real registry handles and load reports
(no network: a handle's channel is only used to call a worker): room by slots and pages, first come first served,
a bounded queue, and the loads of requests that are not this router's."""

import asyncio

import grpc
import pytest

from deltamesh.services.router.admission import Admission
from deltamesh.services.router.legs import MeshError
from deltamesh.services.router.policies import LeastLoaded
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.v1 import common_pb2


def mesh_of(*workers: tuple[str, int, int]) -> tuple[WorkerRegistry, list[WorkerHandle]]:
    """A registry of healthy decode workers, each (address, state slots, KV pages), idle."""
    registry = WorkerRegistry(0.5, 1.0, "s" * 32)
    handles = []
    for address, slots, pages in workers:
        load = common_pb2.WorkerLoad(address=address, state_slots_total=slots, kv_pages_total=pages)
        w = WorkerHandle(address, "decode", static=True, channel=None, healthy=True, load=load)
        registry.keep(w)
        handles.append(w)
    return registry, handles


def admission(registry: WorkerRegistry, max_queued: int = 8, max_wait_s: float = 30.0) -> Admission:
    return Admission(registry, LeastLoaded().pick, max_queued, max_wait_s, page_size=16, max_model_len=4096)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_requests_past_the_slots_wait_and_enter_in_arrival_order():
    async def run():
        registry, (w,) = mesh_of(("d0", 2, 1000))
        adm = admission(registry)
        first = [await adm.admit(10, 6) for _ in range(2)]
        assert all(t.worker is w for t in first) and w.admitted == 2
        order = []

        async def later(i):
            ticket = await adm.admit(10, 6)
            order.append(i)
            return ticket

        waiting = [asyncio.create_task(later(i)) for i in range(3)]
        await settle()
        assert order == [] and len(adm._queue) == 3
        adm.release(first[0])
        await settle()
        assert order == [0]
        adm.release(first[1])
        adm.release(await waiting[0])
        await settle()
        assert order == [0, 1, 2]

    asyncio.run(run())


def test_pages_count_each_request_at_its_longest_and_a_request_longer_than_the_pool_runs_alone():
    async def run():
        registry, (w,) = mesh_of(("d0", 8, 100))
        adm = admission(registry)
        a = await adm.admit(100, 700)  # 800 tokens: 50 pages
        b = await adm.admit(500, 300)  # 50 pages: the pool is full, slots or not
        c = asyncio.create_task(adm.admit(1, 15))  # 1 page
        await settle()
        assert not c.done()
        adm.release(a)
        assert (await c).pages == 1
        adm.release(b)
        adm.release(await c)
        huge = await adm.admit(4000, 96)  # 256 pages of a 100-page pool: alone, as without admission
        small = asyncio.create_task(adm.admit(1, 15))
        await settle()
        assert not small.done()
        adm.release(huge)
        await small

    asyncio.run(run())


def test_a_full_queue_refuses_at_once_and_no_queue_refuses_whatever_has_no_room():
    async def run():
        registry, _ = mesh_of(("d0", 1, 100))
        adm = admission(registry, max_queued=2)
        held = await adm.admit(10, 6)
        queued = [asyncio.create_task(adm.admit(10, 6)) for _ in range(2)]
        await settle()
        with pytest.raises(MeshError) as refused:
            await adm.admit(10, 6)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in refused.value.message
        adm.release(held)
        adm.release(await queued[0])
        adm.release(await queued[1])
        none = admission(registry, max_queued=0)
        held = await none.admit(10, 6)
        with pytest.raises(MeshError, match="queue is full"):
            await none.admit(10, 6)
        none.release(held)

    asyncio.run(run())


def test_a_request_waits_at_most_max_wait_and_one_that_goes_away_leaves_the_queue():
    async def run():
        registry, _ = mesh_of(("d0", 1, 100))
        adm = admission(registry, max_wait_s=0.05)
        held = await adm.admit(10, 6)
        with pytest.raises(MeshError, match="no decode worker had room"):
            await adm.admit(10, 6)
        assert not adm._queue
        gone = asyncio.create_task(adm.admit(10, 6))
        await settle()
        gone.cancel()
        await settle()
        assert not adm._queue
        adm.release(held)
        assert (await adm.admit(10, 6)) is not None  # the slot went to nobody else
        registry.mark_failed(registry.workers["d0"], "test")
        with pytest.raises(MeshError) as gone:
            await adm.admit(10, 6)
        assert gone.value.code == grpc.StatusCode.UNAVAILABLE and "no healthy decode worker" in gone.value.message

    asyncio.run(run())


def test_a_request_for_one_worker_blocks_only_that_worker():
    """The P/D decider's direct requests wait for the decode worker holding their conversation; requests for any
    worker behind them go to another with room, never ahead of them on theirs."""

    async def run():
        registry, (a, b) = mesh_of(("a", 1, 100), ("b", 2, 100))
        adm = admission(registry)
        on_a = await adm.admit(10, 6, only=a)
        assert on_a.worker is a
        direct = asyncio.create_task(adm.admit(10, 6, only=a))
        await settle()
        anywhere = await adm.admit(10, 6)
        assert anywhere.worker is b  # a is full and promised to the direct request
        adm.release(on_a)
        assert (await direct).worker is a

    asyncio.run(run())


def test_a_worker_that_fails_hands_its_direct_waiters_back_with_none():
    async def run():
        registry, (a,) = mesh_of(("a", 1, 100))
        adm = admission(registry)
        held = await adm.admit(10, 6, only=a)
        direct = asyncio.create_task(adm.admit(10, 6, only=a))
        await settle()
        registry.mark_failed(a, "test")
        assert await direct is None
        adm.release(held)

    asyncio.run(run())


def test_other_routers_load_counts_beyond_this_routers_own():
    """The worker's report shows 3 slots used while this router has admitted 1 there: 2 are someone else's, and
    stay counted until a later report says otherwise; this router's own admissions count at once, reports or not."""

    async def run():
        registry, (w,) = mesh_of(("d0", 4, 1000))
        adm = admission(registry)
        mine = await adm.admit(10, 6)
        w.load.state_slots_used = 3
        adm.on_report(w)
        second = await adm.admit(10, 6)  # 1 mine + 2 others + 1 = 4 slots
        third = asyncio.create_task(adm.admit(10, 6))
        await settle()
        assert not third.done()
        w.load.state_slots_used = 2  # the other router's requests ended: only mine are left
        adm.on_report(w)
        assert (await third).worker is w
        for t in (mine, second, await third):
            adm.release(t)
        assert w.admitted == 0

    asyncio.run(run())

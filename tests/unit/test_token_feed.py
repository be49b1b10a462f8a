"""The router's decode leg over the token feed (router/feeds.py, decode.proto `Feed`), against real gRPC servers:
the simulated decode workers of bench/sim_workers.py (the workers' protocol, the mesh secret checked, no model), in
this process, or in a process of their own where one is killed. What the real decode worker's side does is checked
end to end by tests/e2e (test_mesh, test_faults: every decode leg there goes over the feed)."""

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench.sim_workers import FakeDecode, FakeFeed, serve_one, token
from deltamesh.services.router import metrics
from deltamesh.services.router.legs import Inflight, Legs, MeshError
from deltamesh.services.router.policies import LeastLoaded
from deltamesh.services.router.registry import WorkerHandle, WorkerRegistry
from deltamesh.v1 import common_pb2, decode_pb2

ROOT = Path(__file__).resolve().parents[2]
SECRET = "feed-test-secret-0123456789"


def calls(via: str) -> float:
    return metrics.DECODE_CALLS.labels(via)._value.get()


def legs_of(*addresses: str) -> tuple[Legs, list[WorkerHandle]]:
    registry = WorkerRegistry(0.5, 1.0, SECRET)
    handles = []
    for address in addresses:
        load = common_pb2.WorkerLoad(address=address, state_slots_total=256, kv_pages_total=1 << 16)
        channel = grpc.aio.insecure_channel(address)
        handles.append(registry.keep(WorkerHandle(address, "decode", True, channel, healthy=True, load=load)))
    return Legs(registry, LeastLoaded(), None, prefill_retries=2, timeout_s=60), handles


def request(rid: str, prompt_len: int, max_tokens: int) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def collect(legs: Legs, req, first_choice=None, inflight=None) -> list[common_pb2.TokenDelta]:
    out = []
    async for delta in legs.decode(req, "decode", inflight or Inflight(), first_choice):
        out.append(common_pb2.TokenDelta(token_ids=delta.token_ids, finished=delta.finished, usage=delta.usage))
        out[-1].finish_reason = delta.finish_reason
    return out


async def drain(deltas) -> None:
    async for _ in deltas:
        pass


def check_stream(deltas, prompt_len: int, max_tokens: int) -> None:
    """Every token once, in order; running usage; the final delta last, with its finish reason."""
    assert [t for d in deltas for t in d.token_ids] == [token(prompt_len, i) for i in range(max_tokens)]
    delivered = [len(d.token_ids) for d in deltas]
    assert [d.usage.completion_tokens for d in deltas] == [sum(delivered[: i + 1]) for i in range(len(deltas))]
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def fake_decodes(n: int, rate: float, feeds: bool = True) -> tuple[list[FakeDecode], list]:
    workers = [FakeDecode(rate, feeds=feeds) for _ in range(n)]
    servers = [await serve_one(w, "127.0.0.1", SECRET) for w in workers]
    return workers, servers


@pytest.mark.parametrize("feeds", [True, False], ids=["feed", "per-request streams (no Feed on the worker)"])
def test_concurrent_streams_get_their_own_tokens_in_order(feeds):
    async def main():
        workers, servers = await fake_decodes(2, rate=200.0, feeds=feeds)
        legs, _ = legs_of(*(w.address for w in workers))
        before = calls("feed"), calls("stream")
        shapes = [(5 + 7 * i, 3 + i % 9) for i in range(24)]
        results = await asyncio.gather(*(collect(legs, request(f"r{i}", n, m)) for i, (n, m) in enumerate(shapes)))
        for deltas, (n, m) in zip(results, shapes):
            check_stream(deltas, n, m)
        assert calls("feed") - before[0] == (24 if feeds else 0)
        assert calls("stream") - before[1] == (0 if feeds else 24)
        # a worker counts a request until its last delta is written to the feed, which may end after the client
        # has read it: wait (at most 2 s) for the counts to settle
        for _ in range(200):
            if [w.running for w in workers] == [0, 0]:
                break
            await asyncio.sleep(0.01)
        assert [w.running for w in workers] == [0, 0]
        # one feed per worker, open for the next requests; none without Feed on the worker
        assert [len(w.feeds) if w.feeds is not None else None for w in workers] == ([1, 1] if feeds else [None, None])
        await legs.feeds.close()
        for s in servers:
            await s.stop(None)

    asyncio.run(main())


def test_a_slow_consumer_holds_up_no_other_request_on_its_feed():
    async def main():
        (worker,), servers = await fake_decodes(1, rate=200.0)
        legs, (w,) = legs_of(worker.address)
        slow = legs.decode(request("slow", 10, 40), "decode", Inflight())
        first = await anext(slow)  # on the feed now; then it reads nothing while the others run to their end
        others = await asyncio.wait_for(
            asyncio.gather(*(collect(legs, request(f"r{i}", 20 + i, 40)) for i in range(8))), timeout=20
        )
        for i, deltas in enumerate(others):
            check_stream(deltas, 20 + i, 40)
        rest = [first] + [d async for d in slow]  # what waited for it, in order
        check_stream(rest, 10, 40)
        assert len(rest) >= 2, "its tokens waited at the router as they came, not merged"
        await legs.feeds.close()
        await servers[0].stop(None)

    asyncio.run(main())


def test_a_consumer_that_goes_away_or_is_aborted_ends_its_request_on_the_worker_only():
    async def main():
        (worker,), servers = await fake_decodes(1, rate=100.0)
        legs, _ = legs_of(worker.address)
        keep = asyncio.create_task(collect(legs, request("keep", 7, 60)))
        gone = asyncio.create_task(collect(legs, request("gone", 8, 1000)))
        aborted = Inflight()
        stopped = asyncio.create_task(collect(legs, request("aborted", 9, 1000), inflight=aborted))
        while worker.running < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        gone.cancel()  # the client went away
        aborted.abort()  # the client's Abort
        with pytest.raises(asyncio.CancelledError):
            await gone
        with pytest.raises(MeshError) as e:
            await stopped
        assert e.value.code == grpc.StatusCode.CANCELLED
        check_stream(await keep, 7, 60)  # the feed went on for the request that stayed
        for _ in range(200):
            if worker.running == 0:
                break
            await asyncio.sleep(0.01)
        assert worker.running == 0, "the worker's requests of the leavers were cancelled"
        feed = next(iter(worker.feeds.values()))
        assert feed.written == {} and not feed.closed
        await legs.feeds.close()
        await servers[0].stop(None)

    asyncio.run(main())


SPAWN = """
import asyncio, sys
sys.path.insert(0, {root!r})
from bench.sim_workers import FakeDecode, serve_one

async def main():
    w = FakeDecode({rate})
    server = await serve_one(w, "127.0.0.1", {secret!r})
    print(w.address, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def spawn_fake_decode(rate: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SPAWN.format(root=str(ROOT), rate=rate, secret=SECRET)],
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().strip()


def test_a_worker_killed_mid_stream_fails_its_streaming_requests_and_retries_the_others_elsewhere():
    """As a broken Decode stream: a request that streamed fails with UNAVAILABLE (the client is told the decode leg
    failed); one that had not streamed yet goes to another worker; the dead worker is out of routing."""
    victim, address = spawn_fake_decode(rate=20.0)
    try:

        async def main():
            (spare,), servers = await fake_decodes(1, rate=200.0)
            legs, (dead, _) = legs_of(address, spare.address)
            fed, retries = calls("feed"), metrics.RETRIES.labels("decode")._value.get()
            streaming = [legs.decode(request(f"s{i}", 10 + i, 1000), "decode", Inflight(), dead) for i in range(4)]
            firsts = await asyncio.gather(*(anext(s) for s in streaming))  # each streamed a token
            assert all(d.token_ids for d in firsts)
            assert calls("feed") - fed == 4  # on the victim's feed
            victim.kill()  # a Decode stream of its own would break now: the feed breaks instead
            victim.wait()
            waiting = asyncio.create_task(collect(legs, request("late", 30, 12), dead))  # not streamed yet
            for s in streaming:
                with pytest.raises(MeshError) as e:
                    await asyncio.wait_for(drain(s), 20)  # not left waiting on a feed that is gone
                assert e.value.code == grpc.StatusCode.UNAVAILABLE and "decode worker" in e.value.message
            check_stream(await asyncio.wait_for(waiting, 20), 30, 12)  # retried on the spare worker
            assert not dead.healthy
            assert metrics.RETRIES.labels("decode")._value.get() - retries == 1  # the late one only
            assert spare.running == 0
            await legs.feeds.close()
            await servers[0].stop(None)

        asyncio.run(main())
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("worker_ends_them", [True, False], ids=["worker ends its decodes", "router alone sees it"])
def test_a_feed_that_breaks_while_its_worker_lives_fails_its_requests_as_a_broken_stream(worker_ends_them, monkeypatch):
    """The feed alone broken (its stream reset; the Decode calls still open): its requests fail as a broken Decode
    stream would (UNAVAILABLE; the worker out of routing until its next report), their requests on the worker are
    cancelled, and the next request opens a new feed. The worker ends a closed feed's Decodes itself; without that
    (`router alone sees it`), the router's reader must fail them."""
    if not worker_ends_them:
        monkeypatch.setattr(FakeFeed, "close", lambda self: None)

    async def main():
        (worker,), servers = await fake_decodes(1, rate=50.0)
        legs, (w,) = legs_of(worker.address)
        streaming = [legs.decode(request(f"s{i}", 10 + i, 1000), "decode", Inflight()) for i in range(3)]
        await asyncio.gather(*(anext(s) for s in streaming))
        w.feeds.current.call.cancel()
        for s in streaming:
            with pytest.raises(MeshError) as e:
                await asyncio.wait_for(drain(s), 20)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "decode worker" in e.value.message
        assert not w.healthy
        for _ in range(200):
            if worker.running == 0 and not worker.feeds:
                break
            await asyncio.sleep(0.01)
        assert worker.running == 0 and worker.feeds == {}, "nothing of the broken feed's left on the worker"
        w.healthy = True  # its next report
        check_stream(await collect(legs, request("next", 5, 10)), 5, 10)
        assert len(worker.feeds) == 1
        await legs.feeds.close()
        await servers[0].stop(None)

    asyncio.run(main())

"""Leases and the UCX side channel (real ucxx and UCX RMA, in one process over loopback): bytes move exactly,
and a pull of a lease that ended before its reads were checked (pulled, released, expired, another lease's
word) is refused: what its reads brought in is never used."""

import asyncio
import contextlib
import time

import pytest
import torch

from transfer import (
    LeaseCheck,
    LeaseRefused,
    LeaseTable,
    StatePuller,
    StateServer,
    TransferError,
    configure_ucx,
    segments,
    shutdown_ucx,
)


def test_segments_cut_both_region_lists_at_every_boundary():
    assert segments([10, 5], [4, 11]) == [(0, 0, 0, 0, 4), (0, 4, 1, 0, 6), (1, 0, 1, 6, 5)]
    with pytest.raises(TransferError):
        segments([10], [9])


def test_lease_table_ends_each_lease_once_and_zeroes_its_word_first():
    ended = []
    table = LeaseTable(capacity=2)
    # on_end records the words as they are when it runs: the lease's must already be 0
    on_end = lambda r: ended.append((r, table.words.tolist()))  # noqa: E731
    lease = table.offer("a", [torch.zeros(4, dtype=torch.uint8)], 0.05, on_end)
    nonce = lease.nonce
    assert table.words[lease.word] == nonce and all(nonce.to_bytes(8, "little"))  # no zero byte
    assert not table.finish("a", b"x" * 16, pulled=True)  # wrong token: nothing ends
    with pytest.raises(LeaseRefused, match="wrong token"):
        table.extend("a", b"x" * 16, 1)
    time.sleep(0.06)
    assert table.expire() == 1 and ended == [("expired", [0, 0])]  # the word was zero before on_end ran
    assert not table.finish("a", lease.token, pulled=True)  # ended once, never again
    c = table.offer("c", [], 5, lambda r: ended.append((r, None)))
    d = table.offer("d", [], 5, lambda r: ended.append((r, None)))
    assert c.nonce != nonce and d.word != c.word
    with pytest.raises(LeaseRefused, match="too many leases"):
        table.offer("e", [], 5, ended.append)
    assert table.finish("c", c.token, pulled=True) and table.finish("d", d.token, pulled=False)
    assert [r for r, _ in ended] == ["expired", "pulled", "aborted"] and len(table) == 0
    assert table.counts == {"pulled": 1, "released": 0, "expired": 1, "aborted": 1}


def _source(leases, server, ttl_s=10.0):
    """A lease over two regions of one registered pool (odd sizes and offsets), and what a puller is given."""
    src_pool = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    src = [src_pool[: 2 << 20], src_pool[(2 << 20) + 7 :]]
    ended = []
    lease = leases.offer("L", src, ttl_s, ended.append)
    return src, lease, server.regions(src), server.lease_check(lease), ended


@contextlib.asynccontextmanager
async def _side_channel(**puller_options):
    """A holder (lease table + state server) and a puller in this process; UCX released afterwards."""
    leases = LeaseTable()
    server = StateServer(leases)
    await server.start()
    puller = StatePuller(**puller_options)
    try:
        yield leases, server, puller
    finally:
        await puller.close()
        await server.stop()
        shutdown_ucx()  # the UCX worker is bound to this event loop


async def _until(predicate, timeout_s=2.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def test_pull_over_ucx_moves_exact_bytes_and_refuses_an_ended_lease():
    configure_ucx("127.0.0.1")

    async def main():
        async with _side_channel() as (leases, server, puller):
            src, lease, regions, check, ended = _source(leases, server)
            assert len({r.rkey for r in regions}) == 1  # one registration for the pool behind both
            total = sum(r.nbytes for r in regions)
            dst_pool = torch.zeros(4 << 20, dtype=torch.uint8)
            dst = [dst_pool[: 1 << 20], dst_pool[1 << 20 : total]]
            # the puller derives what the word holds from the token and the regions it reads: only the lease's match
            assert LeaseCheck.of(check.address, check.rkey, lease.token, "L", regions) == check
            other = torch.randint(0, 256, (total,), dtype=torch.uint8)
            leases.offer("M", [other], 10, lambda reason: None)  # another request's state
            refused = {
                "wrong token": (regions, LeaseCheck.of(check.address, check.rkey, b"x" * 16, "L", regions)),
                "another lease's regions": (server.regions([other]), LeaseCheck.of(check.address, check.rkey,
                                                                                   lease.token, "L", server.regions([other]))),
                "an old or another lease's word": (regions, LeaseCheck(check.address, check.rkey, check.nonce ^ 1)),
            }  # fmt: skip
            for why, (named, bad) in refused.items():
                with pytest.raises(TransferError, match="ended before its state was read") as e:
                    await puller.pull(server.address, "L", lease.token, bad, named, dst, 10)
                assert e.value.refused, why
            assert ended == [] and len(leases) == 2  # both leases are still there for their right pullers
            assert leases.release("M")
            dst_pool.zero_()
            stats = await puller.pull(server.address, "L", lease.token, check, regions, dst, 10)
            assert torch.equal(torch.cat(src), torch.cat(dst)) and stats.nbytes == total
            assert stats.buffers == len(segments([r.nbytes for r in regions], [b.numel() for b in dst]))
            assert await _until(lambda: ended == ["pulled"]) and len(leases) == 0  # the done notice ended it
            assert [t["lease_id"] for t in server.timeline] == ["L"]
            with pytest.raises(TransferError, match="ended before") as e:  # used once, never again
                await puller.pull(server.address, "L", lease.token, check, regions, dst, 10)
            assert e.value.refused

    asyncio.run(main())


def test_a_warm_up_reads_the_pools_and_lease_words_and_ends_no_lease():
    """StatePuller.warm reads from the holder's pools and its lease words and sends a notice without a lease id,
    which the holder skips: a lease offered before stays pullable."""
    configure_ucx("127.0.0.1")

    async def main():
        async with _side_channel() as (leases, server, puller):
            src, lease, regions, check, ended = _source(leases, server)
            words = server.words()
            assert words.rkey == check.rkey and words.address <= check.address < words.address + words.nbytes
            await puller.warm(server.address, regions, words, torch.device("cpu"), 10)
            await asyncio.sleep(0.1)  # the warm-up notice has reached the holder
            assert ended == [] and len(leases) == 1 and not server.timeline
            dst = [torch.zeros(sum(r.nbytes for r in regions), dtype=torch.uint8)]
            await puller.pull(server.address, "L", lease.token, check, regions, dst, 10)
            assert torch.equal(dst[0], torch.cat(src)) and await _until(lambda: ended == ["pulled"])

    asyncio.run(main())


def test_a_lease_that_ends_while_its_reads_run_fails_the_pull(monkeypatch):
    """The holder releases the lease after the reads completed but before the puller checked the word (the
    failpoint holds it there): the bytes may already be another request's, so the pull is refused."""
    from transfer import failpoints

    configure_ucx("127.0.0.1")
    monkeypatch.setitem(failpoints._ACTIVE, "transfer.before_check", "sleep:0.3")

    async def main():
        async with _side_channel() as (leases, server, puller):
            src, lease, regions, check, ended = _source(leases, server)
            dst = [torch.zeros(sum(r.nbytes for r in regions), dtype=torch.uint8)]
            pull = asyncio.ensure_future(puller.pull(server.address, "L", lease.token, check, regions, dst, 10))
            await asyncio.sleep(0.1)
            assert leases.release("L", lease.token) and ended == ["released"]
            with pytest.raises(TransferError, match="ended before its state was read") as e:
                await pull
            assert e.value.refused

    asyncio.run(main())


def test_an_abandoned_pull_ends_the_lease_at_once(monkeypatch):
    """A puller that gives up (here: its deadline passes while the failpoint holds it before the check) tells
    the holder, which frees the state now, not at the lease's expiry; the puller reuses its buffers once its
    reads are done (nothing of that pull can land in them any more), long before its 30 s grace."""
    from transfer import failpoints

    configure_ucx("127.0.0.1")
    monkeypatch.setitem(failpoints._ACTIVE, "transfer.before_check", "sleep:20")

    async def main():
        async with _side_channel(settle_grace_s=30) as (leases, server, puller):
            src, lease, regions, check, ended = _source(leases, server, ttl_s=60)
            dst = [torch.zeros(sum(r.nbytes for r in regions), dtype=torch.uint8)]
            with pytest.raises(TransferError, match="did not finish"):
                await puller.pull(server.address, "L", lease.token, check, regions, dst, 0.5)
            t0 = time.monotonic()
            released = []
            puller.release_after("L", lambda: released.append(time.monotonic() - t0))
            assert await _until(lambda: ended and released, 5)
            assert ended == ["aborted"] and len(leases) == 0 and released[0] < 2.0
            assert torch.equal(dst[0], torch.cat(src))  # the reads themselves went through

    asyncio.run(main())


def test_an_idle_holder_costs_no_cpu_and_needs_no_helper_thread():
    """The UCX worker is progressed by the event loop: while a holder only waits for requests nothing spins
    (before, ucxx's polling made an idle worker burn a core), and completions need no extra Python thread."""
    import threading

    configure_ucx("127.0.0.1")

    async def main():
        threads = threading.active_count()
        server = StateServer(LeaseTable())
        await server.start()
        try:
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(1.0)
            cpu = time.process_time() - cpu0
            assert cpu < 0.2 * (time.monotonic() - wall0), f"idle holder used {cpu:.2f} CPU-s in 1 s"
            assert threading.active_count() == threads
        finally:
            await server.stop()
            shutdown_ucx()

    asyncio.run(main())


def test_a_spinning_receive_spins_only_until_done_or_its_budget():
    """A receive posted with spin_s keeps the loop progressing UCX (busy) until it completes or its budget ends;
    then the worker sleeps on its wake-up fd again."""
    import numpy as np

    from transfer.ucx import loop_worker

    configure_ucx("127.0.0.1")

    def cpu_share(seconds: float):
        async def measure():
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(seconds)
            return (time.process_time() - cpu0) / (time.monotonic() - wall0)

        return measure()

    async def main():
        ucx = loop_worker.get()
        try:
            ep = ucx.endpoint(ucx.address, error_handling=False)
            got = np.zeros(64, dtype=np.uint8)
            done = ucx.recv(got, 7, spin_s=5.0)  # completes long before its budget
            await ucx.send(ep, np.arange(64, dtype=np.uint8), 7)
            await asyncio.wait_for(done, 5)
            assert got.tolist() == list(range(64))
            assert await cpu_share(0.3) < 0.2, "still spinning after the receive completed"

            never = ucx.recv(np.zeros(8, dtype=np.uint8), 8, spin_s=0.4)  # nobody sends: spins for its budget
            assert await cpu_share(0.3) > 0.6, "a spinning receive did not keep the loop busy"
            await asyncio.sleep(0.2)  # budget over
            assert await cpu_share(0.3) < 0.2, "still spinning after the budget"
            assert not never.done()
            ep.close()
        finally:
            shutdown_ucx()

    asyncio.run(main())


def _holder_process(conn):
    """A holder in its own process (so that it can be killed): offers three leases and waits."""
    configure_ucx("127.0.0.1")

    async def main():
        leases = LeaseTable()
        server = StateServer(leases)
        await server.start()
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        offers = []
        for i in range(3):
            lease = leases.offer(f"L{i}", [src], 60, lambda reason: None)
            offers.append((f"L{i}", lease.token, server.lease_check(lease), server.regions([src])))
        conn.send((server.address, offers))
        await asyncio.sleep(3600)

    asyncio.run(main())


def test_a_holder_that_dies_fails_the_pulls_and_never_crashes_the_puller():
    """SIGKILL the holder after a first pull: the next pulls fail (UCX reports the dead peer) and the puller
    drops and closes its endpoint to it. Closing an endpoint that UCX had already failed used to segfault the
    decode worker."""
    import multiprocessing as mp
    import os
    import signal

    configure_ucx("127.0.0.1")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    holder = ctx.Process(target=_holder_process, args=(child,), daemon=True)
    holder.start()

    async def main():
        assert conn.poll(60), "the holder did not start"
        address, offers = conn.recv()
        puller = StatePuller()  # UCX error handling on: a dead peer is reported
        try:
            dst = [torch.zeros(1 << 20, dtype=torch.uint8)]
            lease_id, token, check, regions = offers[0]
            assert (await puller.pull(address, lease_id, token, check, regions, dst, 10)).nbytes == 1 << 20
            os.kill(holder.pid, signal.SIGKILL)
            holder.join(10)
            for lease_id, token, check, regions in offers[1:]:
                with pytest.raises(TransferError) as e:
                    await puller.pull(address, lease_id, token, check, regions, dst, 5)
                assert not e.value.refused
        finally:
            await puller.close()
            shutdown_ucx()

    try:
        asyncio.run(main())
    finally:
        if holder.is_alive():
            holder.kill()

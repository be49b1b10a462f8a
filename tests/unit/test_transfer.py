"""Leases and the UCX side channel (real ucxx and UCX RMA, in one process over loopback): bytes move exactly,
and a pull with an unknown, wrong-token, expired, already-used or incompatible lease is refused (what its
reads brought in is never used)."""

import asyncio
import time

import pytest
import torch

from transfer import (
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


def test_lease_table_ends_each_lease_once_and_refuses_bad_pulls():
    ended = []
    table = LeaseTable()
    lease = table.offer("a", "h", [torch.zeros(4, dtype=torch.uint8)], 0.05, ended.append)
    with pytest.raises(LeaseRefused, match="wrong token"):
        table.take("a", b"x" * 16, "h")
    with pytest.raises(LeaseRefused, match="incompatible"):
        table.take("a", lease.token, "other")
    with pytest.raises(LeaseRefused, match="unknown"):
        table.take("b", lease.token, "h")
    time.sleep(0.06)
    with pytest.raises(LeaseRefused, match="expired"):
        table.take("a", lease.token, "h")
    assert table.expire() == 1 and ended == ["expired"] and len(table) == 0
    lease = table.offer("c", "h", [], 5, ended.append)
    assert table.take("c", lease.token, "h").lease_id == "c"
    with pytest.raises(LeaseRefused, match="already being pulled"):
        table.take("c", lease.token, "h")
    table.finish_pull("c", ok=True)
    assert ended == ["expired", "pulled"] and table.counts["refused"] == 5


def test_pull_over_ucx_moves_exact_bytes_and_refuses_bad_claims():
    configure_ucx("127.0.0.1")

    async def main():
        leases = LeaseTable()
        server = StateServer(leases)
        await server.start()
        puller = StatePuller()
        try:
            src_pool = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
            src = [src_pool[: 2 << 20], src_pool[(2 << 20) + 7 :]]  # two regions, odd sizes and offsets
            regions = server.regions(src)
            assert [r.nbytes for r in regions] == [b.numel() for b in src]
            assert len({r.rkey for r in regions}) == 1  # one registration for the pool behind both
            dst_pool = torch.zeros(4 << 20, dtype=torch.uint8)
            total = sum(r.nbytes for r in regions)
            dst = [dst_pool[: 1 << 20], dst_pool[1 << 20 : total]]
            ended = []
            lease = leases.offer("L", "h", src, 10, ended.append)
            for token, compat, why in ((b"0" * 16, "h", "wrong token"), (lease.token, "x", "incompatible")):
                with pytest.raises(TransferError, match=why) as e:
                    await puller.pull(server.address, "L", token, compat, regions, dst, 10)
                assert e.value.refused and ended == []  # the lease is still there for the right puller
            dst_pool.zero_()
            stats = await puller.pull(server.address, "L", lease.token, "h", regions, dst, 10)
            assert torch.equal(torch.cat(src), torch.cat(dst)) and stats.nbytes == total
            assert stats.buffers == len(segments([r.nbytes for r in regions], [b.numel() for b in dst]))
            for _ in range(100):  # the done notice ends the lease
                if ended:
                    break
                await asyncio.sleep(0.01)
            assert ended == ["pulled"] and len(leases) == 0
            with pytest.raises(TransferError, match="unknown or ended"):  # used once, never again
                await puller.pull(server.address, "L", lease.token, "h", regions, dst, 10)
        finally:
            await puller.close()
            await server.stop()
            shutdown_ucx()  # the UCX worker is bound to this event loop

    asyncio.run(main())


def test_an_abandoned_pull_ends_the_lease_at_once(monkeypatch):
    """A puller that gives up (here: its deadline passes while the holder stalls before answering) tells the
    holder, which frees the state now, not at its own 30 s deadline; the puller reuses its buffers once its
    reads are done (nothing of that pull can land in them any more), long before its 30 s grace."""
    from transfer import failpoints

    configure_ucx("127.0.0.1")
    monkeypatch.setitem(failpoints._ACTIVE, "transfer.before_status", "sleep:20")

    async def main():
        leases = LeaseTable()
        server = StateServer(leases, send_timeout_s=30)
        await server.start()
        puller = StatePuller(settle_grace_s=30)
        try:
            src, dst = [torch.ones(1 << 20, dtype=torch.uint8)], [torch.zeros(1 << 20, dtype=torch.uint8)]
            ended, released = [], []
            lease = leases.offer("L", "h", src, 60, ended.append)
            with pytest.raises(TransferError, match="did not finish"):
                await puller.pull(server.address, "L", lease.token, "h", server.regions(src), dst, 0.5)
            t0 = time.monotonic()
            puller.release_after("L", lambda: released.append(time.monotonic() - t0))
            while not (ended and released) and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.01)
            assert ended == ["aborted"] and len(leases) == 0
            assert released and released[0] < 2.0
            assert torch.equal(dst[0], src[0])  # the reads themselves went through
        finally:
            await puller.close()
            await server.stop()
            shutdown_ucx()  # the UCX worker is bound to this event loop

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

    from transfer import loop_worker

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

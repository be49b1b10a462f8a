"""Leases and the UCX transport (real ucxx and UCX RMA, in one process over loopback): bytes move exactly, a
pull of a lease that ended before its reads were checked (pulled, released, expired, another lease's word) is
refused: what its reads brought in is never used; a descriptor of another transport or version is refused
before anything moves."""

import asyncio
import contextlib
import time

import pytest
import torch

from deltamesh.transfer import (
    DescriptorError,
    LeaseKey,
    LeaseRefused,
    LeaseTable,
    TransferError,
    open_transport,
    segments,
)
from deltamesh.transfer.ucx import UcxTransport, descriptors, fast_pull_env
from deltamesh.v1.common_pb2 import TransportDescriptor


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


def _source(leases, holder, ttl_s=10.0):
    """A lease over two regions of one registered pool (odd sizes and offsets), and its descriptor."""
    src_pool = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    src = [src_pool[: 2 << 20], src_pool[(2 << 20) + 7 :]]
    ended = []
    lease = leases.offer("L", src, ttl_s, ended.append)
    return src, lease, holder.offer(lease), ended


def _sizes(buffers) -> list[int]:
    return [b.numel() for b in buffers]


@contextlib.asynccontextmanager
async def _transport(settle_grace_s: float = 10.0):
    """A holder (lease table + UCX holder) and a puller in this process, the holder announced to the puller as the
    router announces a worker's; UCX released afterwards."""
    transport = UcxTransport()
    leases = LeaseTable()
    holder = transport.holder(leases)
    await holder.start()
    puller = transport.puller(settle_grace_s)
    assert puller.announce(holder.describe([]))
    try:
        yield leases, holder, puller
    finally:
        await puller.close()
        await holder.stop()
        transport.close()  # the UCX worker is bound to this event loop


async def _until(predicate, timeout_s=2.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return predicate()


def _descriptor(address: bytes, regions, word) -> TransportDescriptor:
    return descriptors.lease_descriptor(address, regions, word)


def test_pull_over_ucx_moves_exact_bytes_and_refuses_an_ended_lease():
    async def main():
        async with _transport() as (leases, holder, puller):
            src, lease, descriptor, ended = _source(leases, holder)
            key = LeaseKey("L", lease.token)
            source = puller.source(descriptor, key, _sizes(src))
            regions, word = source.regions, holder.word_of(lease)
            assert len({r.rkey for r in regions}) == 1  # one registration for the pool behind both
            total = sum(r.nbytes for r in regions)
            dst_pool = torch.zeros(4 << 20, dtype=torch.uint8)
            dst = [dst_pool[: 1 << 20], dst_pool[1 << 20 : total]]
            # the puller derives what the word holds from the token and the regions it reads: only the lease's match
            assert source.check.nonce == lease.nonce
            other = torch.randint(0, 256, (total,), dtype=torch.uint8)
            leases.offer("M", [other], 10, lambda reason: None)  # another request's state
            refused = {
                "wrong token": puller.source(descriptor, LeaseKey("L", b"x" * 16), _sizes(src)),
                "another lease's regions": puller.source(
                    _descriptor(holder.address, holder.regions([other]), word), key, [total]
                ),
                "an old or another lease's word": puller.source(
                    _descriptor(holder.address, regions, descriptors.RemoteRegion(8, word.address + 8, word.rkey)),
                    key,
                    _sizes(src),
                ),
            }
            for why, bad in refused.items():
                with pytest.raises(TransferError, match="ended before its state was read") as e:
                    await puller.pull(bad, dst, 10)
                assert e.value.refused, why
            assert ended == [] and len(leases) == 2  # both leases are still there for their right pullers
            assert leases.release("M")
            dst_pool.zero_()
            stats = await puller.pull(source, dst, 10)
            assert torch.equal(torch.cat(src), torch.cat(dst)) and stats.nbytes == total
            assert stats.buffers == len(segments(_sizes(src), _sizes(dst)))
            assert await _until(lambda: ended == ["pulled"]) and len(leases) == 0  # the done notice ended it
            assert [t["lease_id"] for t in holder.timeline] == ["L"]
            with pytest.raises(TransferError, match="ended before") as e:  # used once, never again
                await puller.pull(source, dst, 10)
            assert e.value.refused

    asyncio.run(main())


def test_a_descriptor_of_another_transport_or_version_is_refused_before_anything_moves():
    """The puller reads no payload it does not speak: another kind, another version, a payload that does not
    parse or does not fit the state's regions, a missing descriptor. Nothing of UCX is started to find out."""
    puller = UcxTransport().puller()
    key = LeaseKey("L", b"t" * 16)
    good = descriptors.lease_descriptor(
        b"addr", [descriptors.RemoteRegion(4, 4096, b"k")], descriptors.RemoteRegion(8, 64, b"w")
    )
    assert puller.source(good, key, [4]).regions[0].address == 4096
    bad = {
        "is not spoken here": [
            TransportDescriptor(kind="tcp", version=descriptors.VERSION, payload=good.payload),
            TransportDescriptor(kind="ucx", version=1, payload=good.payload),
        ],
        "not a UcxLeaseDescriptor": [
            TransportDescriptor(kind="ucx", version=descriptors.VERSION, payload=b"\xff\xff\xff")
        ],
        "one address and key per region": [good],  # for two regions
        "one peer index per region": [_with_peers(good, [b"peer"], [2])],  # no second peer
        "no transport descriptor": [TransportDescriptor()],
    }
    for message, descriptors_ in bad.items():
        for descriptor in descriptors_:
            with pytest.raises(DescriptorError, match=message):
                puller.source(descriptor, key, [2, 2] if message.startswith("one address") else [4])
    with pytest.raises(DescriptorError, match="is not spoken here"):
        asyncio.run(puller.warm(bad["is not spoken here"][0], torch.device("cpu"), 1))
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        open_transport("tcp", None)


def _lease_payload(descriptor: TransportDescriptor):
    from deltamesh.v1 import ucx_pb2

    return ucx_pb2.UcxLeaseDescriptor.FromString(descriptor.payload)


def _with_peers(descriptor: TransportDescriptor, peers: list[bytes], index: list[int]) -> TransportDescriptor:
    d = _lease_payload(descriptor)
    d.peer_addresses[:], d.region_peers[:] = peers, index
    return TransportDescriptor(kind=descriptor.kind, version=descriptor.version, payload=d.SerializeToString())


WORDS = descriptors.RemoteRegion(64 * 8, 1 << 20, b"w")  # a holder's lease words in the tests below


def _announced(holder: bytes, pools: list) -> TransportDescriptor:
    return descriptors.holder_descriptor(holder, pools, WORDS)


def _word(index: int, rkey: bytes = b"w") -> descriptors.RemoteRegion:
    return descriptors.RemoteRegion(8, WORDS.address + 8 * index, rkey)


def test_a_region_names_the_worker_that_holds_it():
    """A region held in another process of the holder's worker (another rank) is read from that process's UCX
    worker; the lease word and the notices stay the holder's."""
    puller = UcxTransport().puller()
    regions = [
        descriptors.RemoteRegion(4, 4096, b"k"),
        descriptors.RemoteRegion(4, 8192, b"j", b"rank1"),
        descriptors.RemoteRegion(2, 100, b"k"),
    ]
    assert puller.announce(_announced(b"holder", regions))  # its registration names rank1 as its rank
    d = descriptors.lease_descriptor(b"holder", regions, _word(3))
    source = puller.source(d, LeaseKey("L", b"t" * 16), [4, 4, 2])
    assert source.address == b"holder" and [r.worker for r in source.regions] == [b"holder", b"rank1", b"holder"]
    own = descriptors.lease_descriptor(b"holder", regions[:1], _word(3))
    assert not _lease_payload(own).peer_addresses  # a holder's own regions name no peer


def test_a_lease_word_vouches_only_for_its_holders_memory():
    """The insider attack of the 2026-12-04 review, in descriptors: a caller holding the mesh secret names another
    request's regions in a prefill worker (as a "peer") and a lease word in memory of its own, set to match. The
    word must be read from the worker holding the regions or one the control plane announced as its rank, and
    from among the lease words the holder announced: anything else is refused before any byte moves (no UCX
    here at all)."""
    puller = UcxTransport().puller()
    victim_regions = [descriptors.RemoteRegion(64, 4096, b"k"), descriptors.RemoteRegion(32, 8192, b"j", b"rank1")]
    assert puller.announce(_announced(b"prefill", victim_regions))
    key = LeaseKey("mine", b"t" * 16)

    def source(holder, regions, word):
        return puller.source(descriptors.lease_descriptor(holder, regions, word), key, [r.nbytes for r in regions])

    source(b"prefill", victim_regions, _word(5))  # the holder's own layout: accepted
    as_peers = [descriptors.RemoteRegion(r.nbytes, r.address, r.rkey, r.worker or b"prefill") for r in victim_regions]
    for holder in (b"insider", b"rank1"):  # another worker's word for the prefill worker's regions
        with pytest.raises(DescriptorError, match="not announced as a rank"):
            source(holder, as_peers, _word(5))
    # announcing itself with the prefill worker (or its rank) as its own rank does not help: first come
    assert not puller.announce(_announced(b"insider", as_peers[:1]))
    assert not puller.announce(_announced(b"insider", as_peers[1:]))
    assert not puller.announce(descriptors.holder_descriptor(b"prefill", victim_regions[:1], WORDS))
    with pytest.raises(DescriptorError, match="not announced as a rank"):
        source(b"insider", as_peers, _word(5))
    # the word moved elsewhere in the holder's memory (into its pool, past its lease words, unaligned, another key)
    for word in (
        descriptors.RemoteRegion(8, 4096 + 8, b"k"),
        _word(64),
        descriptors.RemoteRegion(8, WORDS.address + 4, b"w"),
        _word(5, rkey=b"k"),
    ):
        with pytest.raises(DescriptorError, match="not one of the lease words"):
            source(b"prefill", victim_regions, word)
    # a holder never announced: let through `source` only while it names no announced worker's memory (its pull
    # then waits for its announcement), refused by the check before the pull
    unannounced = source(b"stranger", victim_regions[:1], _word(5))
    with pytest.raises(DescriptorError, match="not announced as a rank"):
        source(b"stranger", as_peers, _word(5))
    from deltamesh.transfer.ucx.holders import KnownHolders

    holders = KnownHolders()
    assert holders.announce(_announced(b"prefill", victim_regions))
    with pytest.raises(DescriptorError, match="its holder was not announced"):
        holders.check(unannounced)


def test_an_announcement_names_its_endpoints_as_its_payload_does():
    """The router compares holders' endpoints without reading payloads: an announcement whose endpoints are not the
    worker addresses its payload names is refused, so a worker cannot hide a claim on another's memory there."""
    puller = UcxTransport().puller()
    regions = [descriptors.RemoteRegion(4, 4096, b"k"), descriptors.RemoteRegion(4, 8192, b"j", b"rank1")]
    good = _announced(b"holder", regions)
    assert list(good.endpoints) == [b"holder", b"rank1"]
    for endpoints in ([b"holder"], [b"holder", b"rank1", b"rank2"], []):
        bad = TransportDescriptor(kind=good.kind, version=good.version, payload=good.payload, endpoints=endpoints)
        with pytest.raises(DescriptorError, match="endpoints are not the worker addresses"):
            puller.announce(bad)
    assert puller.announce(good)


def test_a_pull_from_a_holder_not_announced_yet_waits_for_its_announcement():
    """A worker may be routed to up to a load poll before the workers pulling from it hear of it: its leases pass
    `source` (their memory, its ranks' included, is no one else's), and the pull waits for the announcement, then is
    checked against it: refused, before any byte moves, if none comes."""
    from deltamesh.transfer.ucx.holders import KnownHolders

    regions = [descriptors.RemoteRegion(4, 4096, b"k"), descriptors.RemoteRegion(4, 8192, b"j", b"tp-rank1")]
    descriptor = descriptors.lease_descriptor(b"tp-prefill", regions, _word(1))
    key = LeaseKey("L", b"t" * 16)

    async def main():
        transport = UcxTransport()
        puller = transport.puller()
        try:
            src = puller.source(descriptor, key, [4, 4])
            started = time.monotonic()
            with pytest.raises(TransferError, match="its holder was not announced") as e:
                await puller.pull(src, [torch.zeros(8, dtype=torch.uint8)], timeout_s=0.3)
            assert e.value.refused and time.monotonic() - started >= 0.15  # half its deadline, at most 2 s

            holders = KnownHolders()  # an announcement ends the wait at once, and then vouches for the ranks
            waiting = asyncio.create_task(holders.announced(b"tp-prefill", 30))
            await asyncio.sleep(0.05)
            assert holders.awaits_announcement(src) and not waiting.done()
            assert holders.announce(_announced(b"tp-prefill", regions))
            await asyncio.wait_for(waiting, 1)
            assert not holders.awaits_announcement(src)
            holders.check(src)
        finally:
            await puller.close()
            transport.close()

    asyncio.run(main())


def test_a_warm_up_reads_the_pools_and_lease_words_and_ends_no_lease():
    """The puller's warm-up reads from the holder's pools and its lease words and sends a notice without a lease
    id, which the holder skips: a lease offered before stays pullable."""

    async def main():
        async with _transport() as (leases, holder, puller):
            src, lease, descriptor, ended = _source(leases, holder)
            address, pools, words = descriptors.read_holder(holder.describe(src))
            word = holder.word_of(lease)
            assert address == holder.address and len(pools) == len(src)
            assert words.rkey == word.rkey and words.address <= word.address < words.address + leases.words.numel() * 8
            await puller.warm(holder.describe(src), torch.device("cpu"), 10)
            await asyncio.sleep(0.1)  # the warm-up notice has reached the holder
            assert ended == [] and len(leases) == 1 and not holder.timeline
            dst = [torch.zeros(sum(_sizes(src)), dtype=torch.uint8)]
            await puller.pull(puller.source(descriptor, LeaseKey("L", lease.token), _sizes(src)), dst, 10)
            assert torch.equal(dst[0], torch.cat(src)) and await _until(lambda: ended == ["pulled"])

    asyncio.run(main())


def test_a_lease_that_ends_while_its_reads_run_fails_the_pull(monkeypatch):
    """The holder releases the lease after the reads completed but before the puller checked the word (the
    failpoint holds it there): the bytes may already be another request's, so the pull is refused."""
    from deltamesh.transfer import failpoints

    monkeypatch.setitem(failpoints._ACTIVE, "deltamesh.transfer.before_check", "sleep:0.3")

    async def main():
        async with _transport() as (leases, holder, puller):
            src, lease, descriptor, ended = _source(leases, holder)
            dst = [torch.zeros(sum(_sizes(src)), dtype=torch.uint8)]
            source = puller.source(descriptor, LeaseKey("L", lease.token), _sizes(src))
            pull = asyncio.ensure_future(puller.pull(source, dst, 10))
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
    from deltamesh.transfer import failpoints

    monkeypatch.setitem(failpoints._ACTIVE, "deltamesh.transfer.before_check", "sleep:20")

    async def main():
        async with _transport(settle_grace_s=30) as (leases, holder, puller):
            src, lease, descriptor, ended = _source(leases, holder, ttl_s=60)
            dst = [torch.zeros(sum(_sizes(src)), dtype=torch.uint8)]
            with pytest.raises(TransferError, match="did not finish"):
                await puller.pull(puller.source(descriptor, LeaseKey("L", lease.token), _sizes(src)), dst, 0.5)
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

    async def main():
        threads = threading.active_count()
        transport = UcxTransport()
        holder = transport.holder(LeaseTable())
        await holder.start()
        try:
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(1.0)
            cpu = time.process_time() - cpu0
            assert cpu < 0.2 * (time.monotonic() - wall0), f"idle holder used {cpu:.2f} CPU-s in 1 s"
            assert threading.active_count() == threads
        finally:
            await holder.stop()
            transport.close()

    asyncio.run(main())


def test_a_spinning_receive_spins_only_until_done_or_its_budget():
    """A receive posted with spin_s keeps the loop progressing UCX on every turn until it completes or its budget
    ends; then the worker sleeps on its wake-up fd again. Counted in progress rounds, not CPU time, so that a
    loaded machine cannot make it fail: spinning is thousands of rounds in 0.3 s, a waiting request's safety
    timer (5 ms) about 60, an idle worker none."""
    import numpy as np

    from deltamesh.transfer.ucx import loop_worker

    transport = UcxTransport()

    async def main():
        ucx = loop_worker.get()
        rounds = 0
        progress = ucx._progress

        def counted():
            nonlocal rounds
            rounds += 1
            progress()

        ucx._progress = counted  # the loop looks it up on every turn it schedules

        async def rounds_in(seconds: float) -> int:
            nonlocal rounds
            rounds = 0
            await asyncio.sleep(seconds)
            return rounds

        try:
            ep = ucx.endpoint(ucx.address, error_handling=False)
            got = np.zeros(64, dtype=np.uint8)
            done = ucx.recv(got, 7, spin_s=5.0)  # completes long before its budget
            await ucx.send(ep, np.arange(64, dtype=np.uint8), 7)
            await asyncio.wait_for(done, 5)
            assert got.tolist() == list(range(64))
            assert await rounds_in(0.3) < 10, "still spinning after the receive completed"

            never = ucx.recv(np.zeros(8, dtype=np.uint8), 8, spin_s=0.4)  # nobody sends: spins for its budget
            assert await rounds_in(0.3) > 300, "a spinning receive did not keep the loop progressing"
            await asyncio.sleep(0.2)  # budget over: the request still waits, on the safety timer only
            assert await rounds_in(0.3) < 150, "still spinning after the budget"
            assert not never.done()
            ep.close()
        finally:
            ucx._progress = progress
            transport.close()

    asyncio.run(main())


def _peer_process(conn):
    """Another worker in its own process (so that it can be killed): holds three leases, then pulls the state the
    test's process holds through the same API (a pull the other way round), and waits."""

    async def main():
        transport = UcxTransport()
        leases = LeaseTable()
        holder, puller = transport.holder(leases), transport.puller()
        await holder.start()
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        offers = []
        for i in range(3):
            lease = leases.offer(f"L{i}", [src], 60, lambda reason: None)
            offers.append((LeaseKey(f"L{i}", lease.token), holder.offer(lease)))
        conn.send((holder.describe([]), offers))
        other, key, descriptor, size = await asyncio.to_thread(conn.recv)
        assert puller.announce(other)
        into = torch.zeros(size, dtype=torch.uint8)
        await puller.pull(puller.source(descriptor, key, [size]), [into], 10)
        conn.send(into.sum().item())
        await asyncio.sleep(3600)

    asyncio.run(main())


def test_two_workers_pull_from_each_other_and_a_dead_holder_never_crashes_the_puller():
    """Each process holds and pulls through the same API (prefill <- decode as well as prefill -> decode). Then
    SIGKILL the other process after a first pull from it: the next pulls fail (UCX reports the dead peer) and the
    puller drops and closes its endpoint to it. Closing an endpoint that UCX had already failed used to segfault
    the decode worker."""
    import multiprocessing as mp
    import os
    import signal

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    peer = ctx.Process(target=_peer_process, args=(child,), daemon=True)
    peer.start()

    async def main():
        assert await asyncio.to_thread(conn.poll, 60), "the other process did not start"
        peer_holder, offers = conn.recv()
        async with _transport() as (leases, holder, puller):  # UCX error handling on: a dead peer is reported
            assert puller.announce(peer_holder)
            mine = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
            ended = []
            lease = leases.offer("mine", [mine], 60, ended.append)
            conn.send((holder.describe([]), LeaseKey("mine", lease.token), holder.offer(lease), mine.numel()))
            assert await asyncio.to_thread(conn.recv) == mine.sum().item()  # it pulled the bytes this process holds
            assert await _until(lambda: ended == ["pulled"])
            dst = [torch.zeros(1 << 20, dtype=torch.uint8)]
            key, descriptor = offers[0]
            assert (await puller.pull(puller.source(descriptor, key, [1 << 20]), dst, 10)).nbytes == 1 << 20
            os.kill(peer.pid, signal.SIGKILL)
            peer.join(10)
            for key, descriptor in offers[1:]:
                with pytest.raises(TransferError) as e:
                    await puller.pull(puller.source(descriptor, key, [1 << 20]), dst, 5)
                assert not e.value.refused

    try:
        asyncio.run(main())
    finally:
        if peer.is_alive():
            peer.kill()


def test_the_wire_api_names_no_transport_field_outside_a_transports_own_messages():
    """Services carry transport descriptors opaquely: no field of the gRPC API's messages is a transport's."""
    from deltamesh.v1 import common_pb2, control_pb2, decode_pb2, prefill_pb2, router_pb2

    messages = [
        m
        for module in (common_pb2, control_pb2, decode_pb2, prefill_pb2, router_pb2)
        for m in module.DESCRIPTOR.message_types_by_name.values()
    ]
    names = {f.name for m in messages for f in m.fields}
    assert not {n for n in names if "ucx" in n or "rkey" in n or n in ("region_addresses", "word_address")}
    # endpoints: opaque names of a holder's processes, compared by the router, read by no one outside the transport
    assert {f.name for f in common_pb2.TransportDescriptor.DESCRIPTOR.fields} == {
        "kind",
        "version",
        "payload",
        "endpoints",
    }


_LISTENERS = """
import asyncio, json, os, re, sys
from deltamesh.transfer.ucx import UcxTransport, loop_worker

async def main():
    loop_worker.get()  # this process's UCX worker, as a worker's holder makes it

UcxTransport(sys.argv[1] or None)
asyncio.run(main())
links = []
for fd in os.listdir("/proc/self/fd"):
    try:
        links.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # the listing's own descriptor, closed by now
        pass
sockets = {m.group(1) for link in links if (m := re.fullmatch(r"socket:\\[(\\d+)\\]", link))}
rows = [line.split() for t in ("tcp", "tcp6") for line in open(f"/proc/self/net/{t}").readlines()[1:]]
print("LISTENING", json.dumps([r[1] for r in rows if r[3] == "0A" and r[9] in sockets]), flush=True)
"""


@pytest.mark.parametrize("interface", ["", "lo"])
def test_the_side_channel_listens_on_a_network_only_when_given_an_interface(interface):
    """One host (the default): UCX opens no network transport, so a worker's UCX listens on no socket (the review
    forged addresses to those sockets). --side-channel-interface lo: TCP on that interface only (127.0.0.1)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LISTENERS, interface], capture_output=True, text=True, timeout=120)
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("LISTENING ")]  # UCX logs to stdout too
    listening = json.loads(line.split(" ", 1)[1])  # local "address:port", hex as /proc shows it
    if not interface:
        assert listening == []
    else:
        assert listening and all(a.split(":")[0] in ("0100007F", "0000000000000000FFFF00000100007F") for a in listening)


def test_gpu_pools_keep_cuda_ipc_reads_on_unless_the_user_turned_them_off():
    """UCX turns CUDA IPC reads off where it sees no NVLink (a one-GPU host): pulls between two workers on one GPU
    then go through host memory. A GPU worker turns them on; a user's own setting stands."""
    assert fast_pull_env({}) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert fast_pull_env({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}

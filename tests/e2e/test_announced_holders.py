"""Insider binding, the rest (docs/notes/side-channel-security.md): the router announces every holder, static or
registered, as its report comes, and a puller refuses the leases of holders never announced to it; no worker may
claim another worker's side-channel memory. Real processes: a router given a prefill worker statically
(`--prefill`, the worker not registering), a registered decode worker, and a prefill worker the router was never
told of; a fake worker registered from the test over the control plane."""

from __future__ import annotations

import json
import time
from concurrent import futures

import grpc
import pytest
from harness import Mesh, free_port
from reliability import record

from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.services.common.auth import mesh_metadata
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc, decode_pb2, prefill_pb2, prefill_pb2_grpc, ucx_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.security]
MODEL = str(DEFAULT_MODEL)
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def until(predicate, timeout: float = 90.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except grpc.RpcError:  # not serving yet
            pass
        time.sleep(0.2)
    raise TimeoutError(what)


def log_events(proc, event: str) -> list[dict]:
    out = []
    for line in proc.log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("event") == event:
            out.append(entry)
    return out


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(MODEL, tmp_path_factory.mktemp("announced"))
    try:
        m.static = m.start_unregistered("prefill")  # the router is told of it by a flag only
        m.stranger = m.start_unregistered("prefill")  # never given to the router
        m.router_args = ["--prefill", m.static.address]
        m.start_router()
        m.decode = m.start_worker("decode")
        until(
            lambda: {w.address for w in m.loads() if w.healthy} == {m.static.address, m.decode.address},
            what="the static prefill and the decode worker healthy",
        )
        yield m
    finally:
        m.stop()


def test_a_static_prefill_worker_is_announced_and_serves(mesh, reference_engine):
    """Before, a prefill worker given with --prefill was never announced: its leases were pulled unchecked against
    its lease words. Now the router announces it once it reports: the decode worker warms up to it (it does so
    only for announced holders) and pulls from it, which it would refuse otherwise."""
    prompt = list(range(300, 340))
    with mesh.client() as client:
        got = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    want = reference_engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert list(got.token_ids) == want.token_ids
    assert log_events(mesh.decode, "side channel warmed")
    assert mesh.wait_idle() == {}


def test_a_lease_of_a_holder_never_announced_is_refused(mesh):
    """A prefill worker the router was never told of leases a state; a caller holding the mesh secret hands that
    lease to the decode worker: the pull waits for an announcement that never comes, then is refused before any
    byte moves (ABORTED, the transfer's failure), nothing stays reserved, and the lease is untouched."""
    prompt = list(range(30, 70))
    first = mesh.stranger.stub().Prefill(
        prefill_pb2.PrefillRequest(request_id="stranger", prompt_token_ids=prompt, sampling=GREEDY), timeout=30
    )
    source = decode_pb2.TransferSource(
        lease=first.lease, layout=first.layout, transport=first.transport, first_token_id=first.first.token_ids[0]
    )
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(
            mesh.decode.stub().Decode(
                decode_pb2.DecodeRequest(
                    request_id="stranger", prompt_token_ids=prompt, sampling=GREEDY, source=source
                ),
                timeout=30,
            )
        )
    waited = time.monotonic() - started
    assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
    assert "state transfer failed" in e.value.details() and "was not announced" in e.value.details()
    load = mesh.decode.load()
    assert load.reservations == load.kv_pages_used == load.state_slots_used == 0
    assert mesh.stranger.load().leases == 1  # no read, no notice: the lease is as it was
    release = common_pb2.LeaseRequest(lease_id="stranger", token=first.lease.token)
    assert mesh.stranger.stub().ReleaseLease(release, timeout=5).ok
    record(
        "a caller with the mesh secret hands a decode worker the lease of a prefill worker the router never "
        "announced (not registered, not given with --prefill)",
        "the puller waits for the holder's announcement (at most half the pull's deadline, 2 s), then refuses "
        "before any byte moves: ABORTED, state transfer failed; nothing reserved, the lease untouched",
        "test_a_lease_of_a_holder_never_announced_is_refused",
        f"refused after {waited:.2f}s",
    )


class FakePrefill(prefill_pb2_grpc.PrefillWorkerServicer):
    """A "prefill worker" run by a caller holding the mesh secret, describing its side channel as holding state in
    another worker's UCX worker (as its rank)."""

    def __init__(self, claimed: bytes):
        own = b"fake-ucx-worker"
        payload = ucx_pb2.UcxHolderDescriptor(
            worker_address=own, lease_words_address=4096, lease_words_rkey=b"k", lease_words_bytes=64
        )
        payload.peer_addresses.append(claimed)
        self.described = common_pb2.TransportDescriptor(
            kind="ucx", version=2, payload=payload.SerializeToString(), endpoints=[own, claimed]
        )

    def GetLoads(self, request, context):
        return common_pb2.GetLoadsResponse(
            workers=[common_pb2.WorkerLoad(role="prefill", healthy=True)], holder=self.described
        )


class FakeReports(control_pb2_grpc.WorkerReportsServicer):
    """The fake worker's reports to the router (what real workers push: services/common/reports.py), its false
    description in each."""

    def __init__(self, described: common_pb2.TransportDescriptor):
        self.described = described

    def Watch(self, request, context):
        load = common_pb2.WorkerLoad(role="prefill", healthy=True)
        while context.is_active():
            yield control_pb2.WorkerReport(load=load, prefixes_whole=True, holder=self.described)
            time.sleep(0.25)


def test_no_registration_claims_another_workers_side_channel(mesh, reference_engine):
    """The decode worker holds state too (the prefixes it offers). A caller holding the mesh secret registers a
    "prefill worker" whose description names the decode worker's UCX worker as its rank, so that decode workers
    would take its word for regions there: the router never finds it healthy, announces it to no one, and the
    mesh serves on."""
    decode_endpoints = list(
        mesh.decode.stub().GetLoads(common_pb2.GetLoadsRequest(), timeout=5).holder.endpoints
    )  # what anyone with the mesh secret can learn
    assert decode_endpoints
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    fake_prefill = FakePrefill(decode_endpoints[0])
    prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(fake_prefill, server)
    control_pb2_grpc.add_WorkerReportsServicer_to_server(FakeReports(fake_prefill.described), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    fake = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(mesh.control_address) as channel:
            control = control_pb2_grpc.MeshControlStub(channel)
            register = control_pb2.RegisterWorkerRequest(address=fake, role="prefill", model="deltamesh-tiny")
            polls_seen = 0
            deadline = time.monotonic() + 3.0  # twelve reports at the fake's 0.25 s
            while time.monotonic() < deadline:
                control.RegisterWorker(register, metadata=mesh_metadata(mesh.secret), timeout=5)
                loads = {w.address: w for w in mesh.loads()}
                assert fake in loads and not loads[fake].healthy
                polls_seen += 1
                time.sleep(0.25)
        router = next(p for p in mesh.procs if p.role == "router")
        refused = log_events(router, "worker refused: its side channel names a process another worker holds state in")
        assert [e["address"] for e in refused] == [fake]  # once, however many reports
        prompt = list(range(500, 530))
        with mesh.client() as client:
            got = client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        want = reference_engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert list(got.token_ids) == want.token_ids
    finally:
        server.stop(0)
    record(
        "a caller with the mesh secret registers a fake prefill worker whose side channel claims the decode "
        "worker's UCX worker as its rank (to have decode workers accept its lease words for regions there)",
        "the router refuses a worker whose description names a transport endpoint another worker's names: never "
        "healthy, never routed to, announced to no one; pullers also keep the first claim to an address",
        "test_no_registration_claims_another_workers_side_channel",
        f"unhealthy through {polls_seen} looks over 3 s of reports; the mesh served the next request token-exact",
    )

"""The mesh as real processes on loopback: router + prefill + decode workers over gRPC, state over UCX."""

import asyncio
import random
import time

import grpc
import pytest
from harness import IDLE_TIMEOUT_S, READY_TIMEOUT_S, start_mesh

from deltamesh.client import AsyncClient, DeltameshError, InvalidRequest
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2, router_pb2_grpc, ucx_pb2

pytestmark = pytest.mark.e2e
MODEL = str(DEFAULT_MODEL)


def random_prompts(n, vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def spread(n, lo, hi):
    return [lo + (hi - lo) * i // (n - 1) for i in range(n)]


async def generate_all(address, prompts, **kwargs):
    async with AsyncClient(address) as client:
        return await asyncio.gather(*(client.generate(p, **kwargs) for p in prompts))


def check_against_reference(mesh, reference_engine, n_prompts=20, seed=0):
    vocab = reference_engine.core.model_config.vocab_size
    prompts = random_prompts(n_prompts, vocab, spread(n_prompts, 1, 300), seed)
    results = asyncio.run(generate_all(mesh.router_address, prompts, max_tokens=24, temperature=0))
    ref = reference_engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for r, e in zip(results, ref):
        assert r.token_ids == e.token_ids
        assert r.text == e.text
        assert r.finish_reason == e.finish_reason.value
    assert mesh.wait_idle() == {}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(MODEL, tmp_path_factory.mktemp("mesh"))
    yield m
    m.stop()


def test_concurrent_prompts_match_the_monolithic_engine(mesh, reference_engine):
    check_against_reference(mesh, reference_engine)


def test_two_prefill_two_decode_workers_match_too(tmp_path, reference_engine):
    m = start_mesh(MODEL, tmp_path, prefill=2, decode=2)
    try:
        # before any request, each decode worker sets up its side channel to both prefill workers (the router
        # names them in its registration replies)
        def warmed(p):
            return p.log.read_text().count("side channel warmed")

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and any(warmed(p) < 2 for p in m.workers("decode")):
            time.sleep(0.1)
        assert [warmed(p) for p in m.workers("decode")] == [2, 2]
        check_against_reference(m, reference_engine, seed=1)
        served = {p.address: p.load() for p in m.workers()}
        assert len(served) == 4
    finally:
        m.stop()


def test_a_colocated_worker_over_two_tensor_parallel_ranks_matches_too(tmp_path, reference_engine):
    m = start_mesh(
        MODEL,
        tmp_path,
        prefill=0,
        decode=0,
        colocated=1,
        role_args={"colocated": ["--tensor-parallel-size", "2", "--torch-threads", "1"]},
    )
    try:
        check_against_reference(m, reference_engine, n_prompts=8)
    finally:
        m.stop()


def test_with_the_prefix_cache_on_outputs_are_unchanged_and_repeats_hit(tmp_path, reference_engine):
    """Prefill workers with --prefix-cache: prompts sharing prefixes and a repeated batch give the monolithic
    engine's tokens; the repeat is served from the cache; cached pages do not read as in use (idle check)."""
    m = start_mesh(MODEL, tmp_path, worker_args=["--prefix-cache"])
    try:
        check_against_reference(m, reference_engine, n_prompts=8, seed=2)
        check_against_reference(m, reference_engine, n_prompts=8, seed=2)  # the same prompts again
        prefill = m.workers("prefill")[0].load()
        assert prefill.prefix_cache_hit_tokens > 0 and prefill.kv_pages_cached > 0
    finally:
        m.stop()


def test_cache_aware_routing_sends_a_shared_prefix_to_the_worker_that_caches_it(tmp_path, reference_engine):
    m = start_mesh(MODEL, tmp_path, prefill=2, worker_args=["--prefix-cache"], router_args=["--policy", "cache_aware"])
    try:
        vocab = reference_engine.core.model_config.vocab_size
        system = random_prompts(1, vocab, [120], seed=3)[0]
        turns = [system + tail for tail in random_prompts(4, vocab, [5, 9, 14, 20], seed=4)]
        ref = reference_engine.generate(turns, SamplingParams(max_tokens=8, temperature=0))
        with m.client() as client:
            for prompt, expected in zip(turns, ref):  # one after the other, as turns of a conversation arrive
                assert client.generate(prompt, max_tokens=8, temperature=0).token_ids == expected.token_ids
        hits = sorted(p.load().prefix_cache_hit_tokens for p in m.workers("prefill"))
        assert hits[0] == 0 and hits[1] >= 3 * 112  # every later turn reused the system prompt, on one worker
        assert m.wait_idle() == {}
    finally:
        m.stop()


def test_streaming_delivers_every_token_once_in_order_with_usage(mesh, reference_engine):
    prompt = "The Python language"
    ref = reference_engine.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    with mesh.client() as client:
        deltas = list(client.stream(prompt, max_tokens=30, temperature=0, ignore_eos=True))
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert "".join(d.text for d in deltas) == ref.text
        # each delta's usage counts the tokens delivered so far (a stream that falls behind, as on a busy machine,
        # gets several tokens in one delta)
        delivered = [len(d.token_ids) for d in deltas]
        assert [d.usage.completion_tokens for d in deltas] == [sum(delivered[: i + 1]) for i in range(len(deltas))]
        assert all(delivered) and deltas[-1].usage.completion_tokens == 30
        assert all(d.usage.prompt_tokens == len(ref.prompt_token_ids) for d in deltas)
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == "length"

        # a stop string ends the text before it, with finish_reason stop
        stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
        res = client.generate(prompt, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        assert res.finish_reason == "stop" and res.stop_reason == stop
        assert res.text == ref.text[: ref.text.index(stop)]


def test_cancelling_aborts_both_legs_and_frees_everything(mesh):
    with mesh.client() as client:
        stream = client.stream("A list is", max_tokens=3000, temperature=0, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.cancel()  # SDK cancel: cancels the call
    assert mesh.wait_idle() == {}

    # a client that just goes away (cancels its call, no Abort)
    channel = grpc.insecure_channel(mesh.router_address)
    call = router_pb2_grpc.RouterStub(channel).Generate(
        router_pb2.GenerateRequest(
            text="In this tutorial", sampling=common_pb2.SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
        )
    )
    for i, _ in enumerate(call):
        if i == 5:
            break
    call.cancel()
    channel.close()
    assert mesh.wait_idle() == {}


def test_a_lease_never_pulled_expires_and_frees_prefill_memory(mesh):
    prefill = mesh.workers("prefill")[0]
    reply = prefill.stub().Prefill(
        prefill_pb2.PrefillRequest(
            request_id="lonely",
            prompt_token_ids=list(range(10, 80)),
            lease_ttl_ms=5000,  # long enough to find the state still held (below) on a loaded machine
            sampling=common_pb2.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        ),
        timeout=30,
    )
    assert reply.lease.lease_id == "lonely"
    load = prefill.load()
    assert load.held_states == 1 and load.leases == 1 and load.kv_pages_used > 0
    # its own TTL ended it: 5 s and up to 15 s of a loaded machine's delays, short of the 30 s default TTL
    assert mesh.wait_idle(timeout=20) == {}


def test_wrong_lease_layout_or_transport_is_refused_and_the_state_stays_held(mesh, reference_engine):
    prefill, decode = mesh.workers("prefill")[0], mesh.workers("decode")[0]
    prompt = list(range(20, 60))
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = prefill.stub().Prefill(
        prefill_pb2.PrefillRequest(request_id="guarded", prompt_token_ids=prompt, sampling=sampling), timeout=30
    )

    def decode_with(lease=None, layout=None, transport=None):
        source = decode_pb2.TransferSource(
            lease=lease or first.lease,
            transport=transport or first.transport,
            layout=layout or first.layout,
            first_token_id=first.first.token_ids[0],
        )
        call = decode.stub().Decode(
            decode_pb2.DecodeRequest(request_id="guarded", prompt_token_ids=prompt, sampling=sampling, source=source),
            timeout=30,
        )
        return [t for d in call for t in d.token_ids]

    def refused(code, text, **source):
        with pytest.raises(grpc.RpcError) as e:
            decode_with(**source)
        assert e.value.code() == code and text in e.value.details(), e.value.details()

    def ucx_descriptor(**changes) -> common_pb2.TransportDescriptor:
        payload = ucx_pb2.UcxLeaseDescriptor.FromString(first.transport.payload)
        for field in changes.pop("cleared", ()):
            payload.ClearField(field)
        return common_pb2.TransportDescriptor(
            **{"kind": "ucx", "version": first.transport.version, "payload": payload.SerializeToString(), **changes}
        )

    wrong_token = common_pb2.Lease()
    wrong_token.CopyFrom(first.lease)
    wrong_token.token = bytes(b ^ 1 for b in first.lease.token)
    refused(grpc.StatusCode.ABORTED, "state transfer failed: lease 'guarded' ended before its state", lease=wrong_token)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    refused(invalid, "its token is needed", lease=common_pb2.Lease(lease_id="guarded"))
    refused(invalid, "lease word's address and key", transport=ucx_descriptor(cleared=["word_address", "word_rkey"]))
    # a transport this worker does not speak, or another version of its own: refused before any byte moves
    version = first.transport.version
    refused(invalid, f"'tcp' version {version} is not spoken here", transport=ucx_descriptor(kind="tcp"))
    refused(invalid, f"'ucx' version {version + 1} is not spoken here", transport=ucx_descriptor(version=version + 1))
    bad_layout = common_pb2.StateLayout(compat_hash="0" * 20, num_tokens=40, region_bytes=first.layout.region_bytes)
    refused(grpc.StatusCode.FAILED_PRECONDITION, "incompatible", layout=bad_layout)
    unreadable = ucx_descriptor(cleared=["region_addresses", "region_rkeys"])  # no addresses or keys
    refused(invalid, "one address and key per region", transport=unreadable)
    # the state is still held; the decode worker gave its reservation back (once the refused pull's reads were done)
    assert prefill.load().leases == 1
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while decode.load().kv_pages_used and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.load().kv_pages_used == 0
    tokens = first.first.token_ids[:] + decode_with()
    ref = reference_engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert tokens == ref.token_ids
    assert mesh.wait_idle() == {}


def test_bad_requests_get_invalid_argument(mesh):
    with mesh.client() as client:
        for kwargs in (dict(max_tokens=0), dict(top_p=2.0), dict(max_tokens=10**6)):
            with pytest.raises(InvalidRequest):
                client.generate("hi", **kwargs)
        with pytest.raises(InvalidRequest):
            client.generate([], max_tokens=4)
        with pytest.raises(DeltameshError) as e:
            client.generate("hi", model="no-such-model")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert client.generate("still serving", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_one_access_line_per_request_with_the_id_the_workers_log(mesh):
    import json

    with mesh.client() as client:
        client.generate("Access log", max_tokens=3, ignore_eos=True, request_id="access-log-check")

    def lines(role):
        proc = next(p for p in mesh.procs if p.role == role)
        out = []
        for line in proc.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # the DELTAMESH_READY line and the settings are not log lines
                pass
        return [entry for entry in out if entry.get("request_id") == "access-log-check"]

    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while not any(e["event"] == "request" for e in lines("router")) and time.monotonic() < deadline:
        time.sleep(0.05)
    access = [e for e in lines("router") if e["event"] == "request"]
    assert len(access) == 1 and access[0]["outcome"] == "completed" and access[0]["completion_tokens"] == 3
    assert access[0]["prompt_tokens"] > 0 and access[0]["ttft_s"] <= access[0]["seconds"]
    assert lines("prefill") and lines("decode")  # the workers' lines carry the same id

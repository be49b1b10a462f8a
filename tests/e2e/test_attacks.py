"""The security review's attacks on a running mesh, each tried again against real processes: they must fail."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from harness import ROOT, channel, start_mesh
from reliability import record

from deltamesh.client import Client, DeltameshError, PermissionDenied
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.services.common.auth import MESH_SECRET_ENV
from deltamesh.v1 import common_pb2, control_pb2, control_pb2_grpc, decode_pb2, prefill_pb2, router_pb2, ucx_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.security]

API_KEY = "attack-test-key"
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("attacks")
    key_file = log_dir / "api-key"  # from a file: a key on the command line is in every user's `ps`
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    m = start_mesh(
        str(DEFAULT_MODEL),
        log_dir,
        http=True,
        router_args=["--api-key-file", str(key_file)],
        client_kwargs={"api_key": API_KEY},
    )
    yield m
    m.stop()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_no_one_without_the_mesh_secret_joins_the_mesh_or_reads_its_keys(mesh):
    register = control_pb2.RegisterWorkerRequest(address="127.0.0.1:1", role="decode", model="x")
    # the client API has no control-plane calls at all
    with grpc.insecure_channel(mesh.router_address) as ch:
        assert (
            _code(lambda: control_pb2_grpc.MeshControlStub(ch).RegisterWorker(register, timeout=5))
            == grpc.StatusCode.UNIMPLEMENTED
        )
    # the control plane refuses callers without the secret, or with a wrong one
    for secret in (None, "not-the-mesh-secret"):
        with channel(mesh.control_address, secret=secret) as ch:
            stub = control_pb2_grpc.MeshControlStub(ch)
            assert _code(lambda: stub.RegisterWorker(register, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
            assert (
                _code(lambda: stub.GetLoads(common_pb2.GetLoadsRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
            )
    # so do the workers' own ports: a Prefill answer holds a lease's token and the pools' remote keys
    prefill, decode = mesh.workers("prefill")[0], mesh.workers("decode")[0]
    for secret in (None, "not-the-mesh-secret"):
        assert (
            _code(
                lambda: prefill.stub(secret).Prefill(
                    prefill_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3], sampling=GREEDY), timeout=5
                )
            )
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            _code(
                lambda: list(
                    decode.stub(secret).Decode(
                        decode_pb2.DecodeRequest(request_id="x", prompt_token_ids=[1, 2, 3], sampling=GREEDY), timeout=5
                    )
                )
            )
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (  # the token feed carries every request's tokens (#45)
            _code(lambda: next(iter(decode.stub(secret).Feed(decode_pb2.FeedRequest(feed_id="x"), timeout=5))))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            _code(lambda: prefill.stub(secret).GetLoads(common_pb2.GetLoadsRequest(), timeout=5))
            == grpc.StatusCode.UNAUTHENTICATED
        )
    # nothing registered: the router still knows exactly its own workers, all healthy, and serves
    assert {w.address for w in mesh.loads() if w.healthy} == {p.address for p in mesh.workers()}
    with mesh.client() as client:
        assert client.generate("still ours", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    # readiness says whether the mesh serves, not where its workers are
    ready = httpx.get(f"http://127.0.0.1:{mesh.http_port}/ready", timeout=5).text
    assert not any(p.address in ready for p in mesh.workers())
    record(
        "a client registers a worker, reads loads, calls the workers' ports (no or a wrong mesh secret)",
        "the client API has no control-plane calls; the control plane and every worker port answer "
        "UNAUTHENTICATED; no address, key or lease reaches the caller",
        "test_no_one_without_the_mesh_secret_joins_the_mesh_or_reads_its_keys",
        "refused; the registry still holds exactly the mesh's own workers",
    )


def test_operators_read_loads_with_the_mesh_secret_only(mesh):
    cli = [sys.executable, "-m", "deltamesh.services.cli", "loads", mesh.control_address]  # run from the repo root
    run = lambda env: subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)  # noqa: E731
    env = {k: v for k, v in os.environ.items() if k != MESH_SECRET_ENV}
    ok = run({**env, MESH_SECRET_ENV: mesh.secret})
    assert ok.returncode == 0, ok.stderr
    assert {json.loads(line)["address"] for line in ok.stdout.splitlines()} == {p.address for p in mesh.workers()}
    wrong = run({**env, MESH_SECRET_ENV: "x" * 32})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr and not wrong.stdout
    missing = run(env)
    assert missing.returncode != 0 and "DELTAMESH_MESH_SECRET" in missing.stderr


def test_the_api_key_guards_the_grpc_client_api_too(mesh):
    for kwargs in ({}, {"api_key": "wrong"}):
        with Client(mesh.router_address, retries=0, **kwargs) as client:
            with pytest.raises(PermissionDenied):
                client.generate("no key", max_tokens=2)
            with pytest.raises(PermissionDenied):
                client.list_models()
    with mesh.client() as client:
        assert client.list_models()[0].id == DEFAULT_MODEL.name


def test_api_key_is_checked_on_v1_routes(mesh):
    """The REST gateway's side of the key (this mesh's router has one; the test was test_openai_api's, with a mesh
    of its own)."""
    import openai

    url = f"http://127.0.0.1:{mesh.http_port}"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert (
        ok.completions.create(
            model=DEFAULT_MODEL.name, prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 2
    )
    assert httpx.get(f"{url}/health").status_code == 200  # liveness needs no key
    log = "".join(p.log.read_text() for p in mesh.procs)
    assert API_KEY not in log  # never logged


def test_only_the_owner_aborts_its_request(mesh):
    with mesh.client() as owner, mesh.client() as other:
        with owner.stream("A long story", max_tokens=400, temperature=0, ignore_eos=True) as stream:
            deltas = iter(stream)
            next(deltas)
            for token in (b"", b"\0" * 16):  # another client knows the id (it is in logs, URLs...) but not the token
                with pytest.raises(PermissionDenied):
                    other.abort(stream.request_id, token)
            assert other.abort(stream.request_id, stream.abort_token)  # the owner's token, from anywhere
            last = list(deltas)[-1]
            assert last.finish_reason == "abort" and last.usage.completion_tokens < 400
    assert mesh.wait_idle() == {}
    record(
        "another client aborts a request by its id; a client without the API key",
        "PERMISSION_DENIED without "
        "the abort token of the request's first response; UNAUTHENTICATED on the gRPC client API as on REST",
        "test_only_the_owner_aborts_its_request",
        "refused; the owner's stream went on until its own abort",
    )


def test_an_abort_token_aborts_only_the_run_it_came_with(mesh):
    """The review: the token depended on the request id alone, which the client chooses. A client that ran
    "job-42" once kept a token that aborted anyone's later "job-42"."""
    with mesh.client() as attacker, mesh.client() as victim:
        with attacker.stream("Earlier", max_tokens=2, request_id="job-42") as earlier:
            assert list(earlier)[-1].finished
        kept = earlier.abort_token
        with victim.stream("A long story", max_tokens=200, temperature=0, ignore_eos=True, request_id="job-42") as s:
            deltas = iter(s)
            next(deltas)
            replayed = attacker.abort("job-42", kept)  # a token this router issued, for an earlier run of the id
            with pytest.raises(PermissionDenied):
                attacker.abort("job-42", kept[:-1] + bytes([kept[-1] ^ 1]))  # a forged one
            last = list(deltas)[-1]
        assert not replayed and last.finish_reason == "length" and last.usage.completion_tokens == 200
        with victim.stream("Another story", max_tokens=200, ignore_eos=True, request_id="job-42") as s:
            deltas = iter(s)
            next(deltas)
            assert victim.abort("job-42", s.abort_token)  # the run's own token still aborts it
            assert list(deltas)[-1].finish_reason == "abort"
    assert mesh.wait_idle() == {}
    record(
        "a client keeps the abort token of its request 'job-42' and replays it against a later 'job-42' of another "
        "client; a forged token",
        "the token is a nonce of the run and a MAC of the id and the nonce: a kept token finds nothing (found=false), "
        "a forged one is PERMISSION_DENIED; the run's own token still aborts it",
        "test_an_abort_token_aborts_only_the_run_it_came_with",
        "replay found nothing and the victim's stream ran to its 200 tokens; forged refused; own token aborted",
    )


def _prefill(prefill, rid: str, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    return prefill.stub().Prefill(
        prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY), timeout=30
    )


def _decode(decode, rid: str, prompt: list[int], first: prefill_pb2.PrefillResponse, transport=None):
    source = decode_pb2.TransferSource(
        lease=first.lease,
        transport=transport or first.transport,
        layout=first.layout,
        first_token_id=first.first.token_ids[0],
    )
    call = decode.stub().Decode(
        decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, source=source), timeout=30
    )
    return [t for d in call for t in d.token_ids]


def test_a_lease_is_bound_to_its_regions_and_token_and_pulled_once(mesh, reference_engine):
    prefill, decode = mesh.workers("prefill")[0], mesh.workers("decode")[0]
    prompt_a, prompt_b = list(range(30, 70)), list(range(100, 140))  # same length: same-sized states
    a, b = _prefill(prefill, "lease-a", prompt_a), _prefill(prefill, "lease-b", prompt_b)
    # request b's state read under a's lease (a's token and word, b's regions): refused, nothing used
    a_word_b_regions = ucx_pb2.UcxLeaseDescriptor.FromString(b.transport.payload)
    a_word = ucx_pb2.UcxLeaseDescriptor.FromString(a.transport.payload)
    a_word_b_regions.word_address, a_word_b_regions.word_rkey = a_word.word_address, a_word.word_rkey
    with pytest.raises(grpc.RpcError) as e:
        _decode(
            decode,
            "lease-a",
            prompt_a,
            a,
            common_pb2.TransportDescriptor(
                kind="ucx", version=a.transport.version, payload=a_word_b_regions.SerializeToString()
            ),
        )
    assert e.value.code() == grpc.StatusCode.ABORTED and "regions are not the lease's" in e.value.details()
    # no lease ends without its token: a tokenless Abort, a wrong token, a TTL past the cap
    stub = prefill.stub()
    stub.Abort(common_pb2.AbortRequest(request_id="lease-a"), timeout=5)
    wrong = common_pb2.LeaseRequest(lease_id="lease-a", token=b"\0" * 16)
    assert not stub.ReleaseLease(wrong, timeout=5).ok
    for ttl_ms in (2**32 - 1, 301_000):
        assert (
            _code(
                lambda: stub.ExtendLease(
                    common_pb2.LeaseRequest(lease_id="lease-a", token=a.lease.token, ttl_ms=ttl_ms), timeout=5
                )
            )
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (
            _code(
                lambda: stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="long", prompt_token_ids=prompt_a, sampling=GREEDY, lease_ttl_ms=ttl_ms
                    ),
                    timeout=5,
                )
            )
            == grpc.StatusCode.INVALID_ARGUMENT
        )
    assert prefill.load().leases == 2
    # each lease still serves its own puller, exactly, and only once
    ref = lambda p: reference_engine.generate(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]  # noqa: E731
    assert a.first.token_ids[:] + _decode(decode, "lease-a", prompt_a, a) == ref(prompt_a).token_ids
    assert b.first.token_ids[:] + _decode(decode, "lease-b", prompt_b, b) == ref(prompt_b).token_ids
    with pytest.raises(grpc.RpcError) as e:
        _decode(decode, "lease-a-again", prompt_a, a)
    assert e.value.code() == grpc.StatusCode.ABORTED and "state transfer failed" in e.value.details()
    assert mesh.wait_idle() == {}
    record(
        "a pull of one request's state under another's lease; tokenless or wrong-token lease ends; a 49-day TTL",
        "the pull is refused (the lease word is a MAC of the token and the lease's exact regions) and its bytes are "
        "unused; the lease stays for its puller; TTLs over --max-lease-ttl are INVALID_ARGUMENT",
        "test_a_lease_is_bound_to_its_regions_and_token_and_pulled_once",
        "all refused; each lease then pulled exactly once, token-exact against the monolithic engine",
    )


@pytest.mark.alone  # bounds wall-clock times
def test_abandoned_streams_free_every_lease_within_a_second(mesh):
    """Six n=16 streams, each dropped by its client after its first chunk (the review: they held all 32 prefill
    slots until their leases' TTL, and other users waited 2-26 s)."""
    body = {
        "model": DEFAULT_MODEL.name,
        "prompt": "Once upon a time",
        "n": 16,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.8,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    opened = []
    with httpx.Client(base_url=f"http://127.0.0.1:{mesh.http_port}", headers=headers, timeout=60) as http:
        for _ in range(6):
            cm = http.stream("POST", "/v1/completions", json=body)
            response = cm.__enter__()
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping it mid-stream would close the connection now
            next(lines)
            opened.append((cm, lines))
        for cm, lines in opened:  # hang up
            lines.close()
            cm.__exit__(None, None, None)
    hung_up = time.monotonic()
    prefill = mesh.workers("prefill")[0]
    while (prefill.load().leases or prefill.load().held_states) and time.monotonic() - hung_up < 5:
        time.sleep(0.02)
    freed_s = time.monotonic() - hung_up
    print(f"leases and held states back to zero {freed_s:.3f} s after the clients hung up")
    assert freed_s < 1.0
    assert mesh.wait_idle() == {}
    with mesh.client() as client:  # and other users are served at once
        started = time.monotonic()
        assert client.generate("next user", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        next_user_s = time.monotonic() - started
        assert next_user_s < 2.0
    record(
        "six n=16 REST streams dropped by their clients after the first chunk",
        "every choice's prefill leg, lease and decode leg ends at once (the router chose each lease's token, so "
        "it ends leases whose answers it never read)",
        "test_abandoned_streams_free_every_lease_within_a_second",
        f"leases and held states back to 0 in {freed_s:.2f}s; the next request served in {next_user_s:.2f}s",
    )


@pytest.mark.alone  # bounds wall-clock times
def test_a_request_whose_holder_died_fails_fast(tmp_path):
    """The review: requests whose prefill holder died waited ~28 s, then got 429 'decode worker is full'."""
    mesh = start_mesh(str(DEFAULT_MODEL), tmp_path)
    try:
        prefill, decode = mesh.workers("prefill")[0], mesh.workers("decode")[0]
        prompt = list(range(30, 70))
        first = _prefill(prefill, "orphan", prompt)
        mesh.kill(prefill)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            _decode(decode, "orphan", prompt, first)
        waited = time.monotonic() - started
        print(f"decode of a dead holder's lease failed after {waited:.3f} s: {e.value.code().name} {e.value.details()}")
        # the transfer's failure (ABORTED), not the decode worker's: the router would not count it against the worker
        assert e.value.code() == grpc.StatusCode.ABORTED and "state transfer failed" in e.value.details()
        assert waited < 5.0
        load = decode.load()
        assert load.reservations == load.kv_pages_used == load.state_slots_used == 0
        record(
            "a decode request whose prefill holder was SIGKILLed after leasing",
            "the pull fails at once (ABORTED, state transfer failed) and the decode worker's reservation is back",
            "test_a_request_whose_holder_died_fails_fast",
            f"ABORTED after {waited * 1000:.0f} ms",
        )
    finally:
        mesh.stop()


def test_router_protos_carry_no_transport_fields():
    """What a client sees of the router (its API) names no worker addresses, keys or lease fields."""
    names = {f.name for m in router_pb2.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    assert not names & {"ucx_address", "region_rkeys", "side_channel", "transport", "lease", "token", "address"}
    assert set(router_pb2.DESCRIPTOR.services_by_name["Router"].methods_by_name) == {"Generate", "Abort", "ListModels"}


def test_client_errors_name_no_worker(tmp_path):
    """The review: errors sent to clients named the workers' addresses. A decode worker SIGKILLed under a gRPC and a
    REST stream: both clients are told the request failed in the mesh, the router's log says which worker."""
    mesh = start_mesh(str(DEFAULT_MODEL), tmp_path, http=True)
    try:
        decode = mesh.workers("decode")[0]
        body = {"model": DEFAULT_MODEL.name, "prompt": "A long story", "max_tokens": 3000, "ignore_eos": True}
        with mesh.client(retries=0) as client, httpx.Client(timeout=60) as http:
            stream = client.stream("A long story", max_tokens=3000, ignore_eos=True)
            deltas = iter(stream)
            next(deltas)
            with http.stream(
                "POST", f"http://127.0.0.1:{mesh.http_port}/v1/completions", json=body | {"stream": True}
            ) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                mesh.kill(decode)
                with pytest.raises(DeltameshError) as grpc_error:
                    list(deltas)
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        rest_error = events[-1]["error"]["message"]
        told = f"{grpc_error.value} / {rest_error}"
        print(f"told the clients: {told}")
        assert rest_error and "127.0.0.1" not in told and decode.address.split(":")[1] not in told, told
        router_log = mesh.procs[0].log.read_text()
        assert decode.address in router_log  # the operator's side: which worker failed
        record(
            "errors sent to clients when a worker fails (a decode worker SIGKILLed under a gRPC and a REST stream)",
            "a generic message and the status (the worker's own words only for bad input or no room); the worker's "
            "address and details in the router's log",
            "test_client_errors_name_no_worker",
            f"told: {rest_error!r}; the router's log names the worker",
        )
    finally:
        mesh.stop()


def test_secret_files_others_may_write_are_refused(tmp_path):
    """The review: a world-writable mesh secret file was taken silently (whoever can write it can hand the next
    process started with it a secret of their own)."""
    secret, key = tmp_path / "mesh-secret", tmp_path / "api-key"
    for path, mode in ((secret, 0o666), (key, 0o620)):
        path.write_text("s" * 32)
        path.chmod(mode)
    env = {k: v for k, v in os.environ.items() if k != MESH_SECRET_ENV}
    for argv in (
        ["router", "--mesh-secret-file", str(secret)],
        ["serve", "--api-key-file", str(key)],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "deltamesh.services.cli", *argv, "--grpc-port", "0", "--control-port", "0"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        refusal = [line for line in done.stderr.splitlines() if "chmod go-w" in line]
        assert done.returncode == 2 and refusal, done.stderr
    record(
        "a mesh secret file writable by all, an API key file writable by its group",
        "the process refuses to start, in one line naming the file, its mode and `chmod go-w`",
        "test_secret_files_others_may_write_are_refused",
        "both refused (router, serve), exit status 2",
    )


def test_a_killed_serve_leaves_no_process_behind_even_a_stopped_one(tmp_path):
    """The review: a SIGSTOPped worker outlived a SIGKILLed `serve` (the parent-death SIGTERM waits while a process
    is stopped). Each child of serve is in a process group of its own, which serve's death orphans: the kernel sends
    an orphaned group holding a stopped process SIGHUP and SIGCONT."""
    from test_supervisor import Serve

    serve = Serve(tmp_path, prefill=1, decode=1)
    try:
        serve.wait_ready(workers=2)
        (stopped,) = serve.pids("decode")
        os.kill(stopped, signal.SIGSTOP)
        # the kernel orphans the group at serve's exit only if the worker is stopped by then: on a loaded machine the
        # pending SIGSTOP can take effect after serve's exit (no SIGHUP/SIGCONT then), so wait until it has
        stopped_by = time.monotonic() + 10
        while Path(f"/proc/{stopped}/stat").read_text().split()[2] != "T" and time.monotonic() < stopped_by:
            time.sleep(0.05)
        serve.popen.kill()
        serve.popen.wait(10)
        killed = time.monotonic()
        while serve.pids_left() and time.monotonic() - killed < 30:
            time.sleep(0.2)
        gone_s = time.monotonic() - killed
        left = {pid: Path(f"/proc/{pid}/stat").read_text().split()[2:6] for pid in serve.pids_left()}
        assert not left, f"children of a SIGKILLed serve kept running (state, ppid, pgrp, session): {left}"
        record(
            "`deltamesh serve` SIGKILLed while one of its workers is SIGSTOPped",
            "every child stops: the running ones on their parent-death SIGTERM, the stopped one woken by the kernel "
            "(its orphaned process group gets SIGHUP and SIGCONT) and stopped gracefully",
            "test_a_killed_serve_leaves_no_process_behind_even_a_stopped_one",
            f"no process of the mesh left {gone_s:.1f}s after serve was killed",
        )
    finally:
        serve.stop()

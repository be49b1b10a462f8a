"""Attacks from the security reviews on the router's edges, against real processes: input that used to answer
500 (lone surrogates, integers past the wire types, booleans as token ids), input that used to block the
router's event loop for seconds (huge prompts, prompt batches, chats), request ids that left calls open, gRPC
fields REST bounded and gRPC did not, HTTP clients that never finish sending their headers or their body, and a
request of 1,024 prompts that held back every other client's first token."""

import contextlib
import json
import re
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from harness import start_mesh
from reliability import record

from deltamesh.client import InvalidRequest
from deltamesh.engine import DEFAULT_MODEL
from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.security]
MODEL_ID = DEFAULT_MODEL.name
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(
        str(DEFAULT_MODEL),
        tmp_path_factory.mktemp("edge"),
        http=True,
        router_args=["--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-body-timeout", str(BODY_TIMEOUT_S)],
    )
    yield m
    m.stop()


@pytest.fixture(scope="module")
def url(mesh):
    return f"http://127.0.0.1:{mesh.http_port}"


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.router_address) as channel:
        yield router_pb2_grpc.RouterStub(channel)


def post(url: str, path: str, body: dict | str, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)  # json.dumps writes "\ud800" as an escape
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=timeout)


def completion(**kw) -> dict:
    return {"model": MODEL_ID, "prompt": "x", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


LONE = "a\ud800b"
REFUSED = [
    ("/v1/completions", completion(prompt=LONE)),
    ("/v1/completions", completion(prompt=["ok", LONE])),
    ("/v1/completions", completion(stop=LONE)),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": LONE}])),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": LONE}]}])),
    ("/v1/chat/completions", chat(stop=[LONE])),
    ("/v1/chat/completions", chat(messages=[])),
    ("/v1/completions", completion(top_k=2**32)),
    ("/v1/completions", completion(max_tokens=2**32)),
    ("/v1/chat/completions", chat(max_completion_tokens=2**32)),
    ("/v1/completions", completion(seed=2**64)),
    ("/v1/completions", completion(seed=10**400)),
    ("/v1/completions", completion(seed=-1)),
    ("/v1/completions", completion(logprobs=21)),  # vLLM's limit, 20
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21)),
    ("/v1/completions", completion(n=1025)),  # over --max-choices
    ("/v1/completions", completion(n=True)),
    ("/v1/completions", completion(prompt=[True, False])),
    ("/v1/completions", completion(prompt=[1.0, 2.0])),
    ("/v1/completions", completion(prompt=[[1, True]])),
    ("/v1/completions", completion(stop_token_ids=[True])),
    ("/v1/completions", completion(stop_token_ids=[2.0])),
    ("/v1/completions", completion(stop_token_ids=[2**32])),
    ("/v1/completions", completion(stop_token_ids=[1] * 1025)),
    ("/v1/completions", completion(prompt=["x"] * 1025)),  # over --max-prompts
    ("/v1/completions", completion(prompt=["x"] * 100, n=11)),  # over --max-choices
    ("/v1/completions", completion(prompt=[1] * 5000)),  # more token ids than the context
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x"}] * 4097)),  # over --max-messages
]


@pytest.mark.parametrize("path,body", REFUSED, ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _) in enumerate(REFUSED)])
def test_bad_input_is_a_400_in_openai_shape(url, path, body):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert "Error(" not in err["message"] and "Traceback" not in err["message"]  # no internals


def test_bad_model_name_is_a_404_not_a_500(url):
    r = post(url, "/v1/completions", completion(model=LONE))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_whole_seed_range_is_served_on_both_edges(url, mesh):
    """seed is a uint64 on the wire: [0, 2**64) is accepted everywhere (n choices use seed + i mod 2**64)."""
    for seed in (0, 2**63, 2**64 - 1):
        r = post(url, "/v1/completions", completion(seed=seed, n=2, temperature=1.0))
        assert r.status_code == 200, r.text
        with mesh.client(retries=0) as client:
            assert client.generate("x", max_tokens=2, seed=seed, ignore_eos=True).usage.completion_tokens == 2


def test_grpc_refuses_the_same_input(mesh, stub):
    def call(**fields):
        request = router_pb2.GenerateRequest(model=MODEL_ID, **fields)
        request.sampling.max_tokens = request.sampling.max_tokens or 2
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        return e.value

    assert call(chat=router_pb2.ChatMessages()).code() == grpc.StatusCode.INVALID_ARGUMENT  # no messages
    too_many = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="x")] * 4097)
    assert call(chat=too_many).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert call(token_ids=router_pb2.TokenIds(ids=[1] * 5000)).code() == grpc.StatusCode.INVALID_ARGUMENT
    stop = common_pb2.StopConditions(stop_token_ids=[2**32 - 1])
    assert call(text="x", stop=stop).code() == grpc.StatusCode.INVALID_ARGUMENT
    # Bytes that are not UTF-8 in a string field: the message cannot be parsed; never INTERNAL (grpc answers
    # UNKNOWN from its deserializer, before the servicer runs).
    raw = router_pb2.GenerateRequest(model=MODEL_ID, text="abc").SerializeToString().replace(b"abc", b"a\xff\xfe")
    with grpc.insecure_channel(mesh.router_address) as channel:
        generate = channel.unary_stream("/deltamesh.v1.Router/Generate")
        with pytest.raises(grpc.RpcError) as e:
            list(generate(raw, timeout=30))
    assert e.value.code() != grpc.StatusCode.INTERNAL, e.value
    # A proto string cannot carry a lone surrogate: the SDK refuses it before sending.
    with mesh.client(retries=0) as client:
        for kwargs in (
            dict(prompt=LONE),
            dict(prompt=[{"role": "user", "content": LONE}]),
            dict(prompt="x", stop=[LONE]),
        ):
            with pytest.raises(InvalidRequest):
                client.generate(max_tokens=2, **kwargs)


# ---- the event loop under oversized input ------------------------------------------------------------------
class TimedStream(threading.Thread):
    """A greedy stream that records when each of its deltas arrives."""

    def __init__(self, client, prompt: str):
        super().__init__(daemon=True)
        self.stream = client.stream(prompt, max_tokens=3500, temperature=0, ignore_eos=True, timeout=300)
        self.arrivals: list[float] = []

    def run(self) -> None:
        try:
            for _ in self.stream:
                self.arrivals.append(time.monotonic())
        except Exception:  # cancelled at the end of the test
            pass

    def max_gap(self, start: float, end: float) -> float:
        times = [t for t in self.arrivals if start <= t <= end]
        return max((b - a for a, b in zip(times, times[1:])), default=float("inf"))


@pytest.mark.alone  # bounds wall-clock times
def test_oversized_input_never_stalls_other_streams(mesh, url):
    """While 4 streams run, a 4 MB text over gRPC, 10,000 prompts and a 100k-message chat over REST are each
    refused at once, and no stream waits much longer between two tokens than it did before (200 ms plus five
    times its quiet gap)."""
    huge_text = "x" * ((4 << 20) - 1024)  # just under the request cap: refused for its length, never tokenised
    many_prompts = json.dumps(completion(prompt=["hello"] * 10_000))
    long_chat = json.dumps(chat(messages=[{"role": "user", "content": "hi"}] * 100_000))
    assert len(long_chat) < 4 << 20  # under the body cap: the chat itself must be refused

    with mesh.client(retries=0) as client:
        streams = [TimedStream(client, f"Story number {i}:") for i in range(4)]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while min(len(s.arrivals) for s in streams) < 30 and time.monotonic() < deadline:  # warm-up
            time.sleep(0.05)
        quiet_start = time.monotonic()
        time.sleep(2.0)
        quiet = max(s.max_gap(quiet_start, time.monotonic()) for s in streams)

        attack_start = time.monotonic()
        took = {}
        t = time.monotonic()
        with pytest.raises(InvalidRequest, match="characters"):
            client.generate(huge_text, max_tokens=2, timeout=30)
        took["4 MB gRPC text"] = time.monotonic() - t
        for name, path, body in (
            ("10k prompts", "/v1/completions", many_prompts),
            ("100k-message chat", "/v1/chat/completions", long_chat),
        ):
            t = time.monotonic()
            r = post(url, path, body)
            took[name] = time.monotonic() - t
            assert r.status_code == 400 and "too many" in r.json()["error"]["message"], r.text
        time.sleep(0.5)
        attack_end = time.monotonic()
        gaps = [s.max_gap(attack_start, attack_end) for s in streams]
        for s in streams:
            s.stream.cancel()
        for s in streams:
            s.join(10)

        record(
            "a 4 MB text prompt over gRPC, 10,000 prompts and a 100k-message chat over REST, beside 4 streams",
            "each refused with a 400 / INVALID_ARGUMENT before any tokenising; the router's loop keeps streaming",
            "test_oversized_input_never_stalls_other_streams",
            f"refused in {', '.join(f'{k} {v:.2f}s' for k, v in took.items())}; largest inter-token gap "
            f"{max(gaps) * 1000:.0f} ms (without the attack {quiet * 1000:.0f} ms)",
        )
        assert all(v < 2.0 for v in took.values()), took
        # A blocked loop shows as a gap of seconds (tokenising 8 MB). Parsing the 4 MB chat body (json, in C, under
        # the GIL) takes tens of ms on an idle machine and more under load, as does the quiet gap.
        assert max(gaps) < 0.2 + 5 * quiet, (
            f"largest inter-token gap under attack {max(gaps):.3f} s (without: {quiet:.3f} s); {took}"
        )
        assert all(w.healthy for w in mesh.loads())
        assert client.generate("Still serving", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    assert mesh.wait_idle(timeout=15) == {}


# ---- HTTP clients that never finish their headers -----------------------------------------------------------
def closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reads until EOF)."""
    start = time.monotonic()
    sock.settimeout(limit)
    while sock.recv(4096):
        pass
    return time.monotonic() - start


@pytest.mark.alone  # bounds wall-clock times
def test_a_client_that_never_finishes_its_headers_is_cut_off(mesh, url):
    port = mesh.http_port
    with socket.create_connection(("127.0.0.1", port)) as partial:
        partial.sendall(b"GET /health HT")  # half a request line, then nothing
        assert closed_after(partial, HEADER_TIMEOUT_S + 3) < HEADER_TIMEOUT_S + 2
    with socket.create_connection(("127.0.0.1", port)) as silent:  # connects and never sends a byte
        assert closed_after(silent, HEADER_TIMEOUT_S + 3) < HEADER_TIMEOUT_S + 2
    with socket.create_connection(("127.0.0.1", port)) as kept:  # a second request on a kept-alive connection
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in kept.recv(4096)
        kept.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert closed_after(kept, HEADER_TIMEOUT_S + 3) < HEADER_TIMEOUT_S + 2
    with socket.create_connection(("127.0.0.1", port)) as slow:  # slow but in time: served
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(HEADER_TIMEOUT_S / 2)
        slow.sendall(b"Host: x\r\nConnection: close\r\n\r\n")
        slow.settimeout(5)
        assert b"200 OK" in slow.recv(4096)
    assert httpx.get(f"{url}/health").status_code == 200


def test_endless_headers_are_refused_and_a_large_body_is_not(mesh, url):
    """llhttp (uvicorn's httptools parser) keeps headers of any size; within the header deadline a client on
    loopback could send gigabytes of them. The gateway stops a head at 64 KiB with a 400 and closes; a request
    whose body is large but whose head is small is served as before (its body is not counted as head)."""
    with socket.create_connection(("127.0.0.1", mesh.http_port)) as endless:
        endless.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sent, answer = 0, b""
        with contextlib.suppress(ConnectionError):  # the server may close while we still send
            while sent < 4 << 20:
                endless.sendall(b"X-Filler: " + b"a" * 8000 + b"\r\n")
                sent += 8012
        endless.settimeout(5)
        with contextlib.suppress(ConnectionError):
            while chunk := endless.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") and b"too large" in answer, answer[:200]
        assert sent < 4 << 20, "the head was never cut"
    padded = completion(prompt="x", user="u" * (1 << 20))  # a 1 MiB body in one request, head of a few lines
    r = post(url, "/v1/completions", padded)
    assert r.status_code == 200, r.text[:300]
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.alone  # bounds wall-clock times
def test_a_body_sent_a_byte_at_a_time_is_cut_off(mesh, url):
    """The review: a client that sent its headers, then its body a byte every 2 s, was never cut."""
    body = json.dumps(completion()).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    with socket.create_connection(("127.0.0.1", mesh.http_port)) as slow:
        slow.sendall(head)
        started, sent, reply = time.monotonic(), 0, b""
        slow.settimeout(0.5)
        while time.monotonic() - started < BODY_TIMEOUT_S + 10:
            try:
                slow.sendall(body[sent : sent + 1])
                sent += 1
                chunk = slow.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset once the server closed
                break
            if not chunk:
                break
            reply += chunk
        cut_s = time.monotonic() - started
    print(f"slow body cut after {cut_s:.2f} s and {sent} of {len(body)} bytes: {reply[:80]!r}")
    assert reply.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in reply, reply
    assert sent < len(body) and cut_s < BODY_TIMEOUT_S + 3
    with socket.create_connection(("127.0.0.1", mesh.http_port)) as slow_in_time:  # slow, but in time: served
        slow_in_time.sendall(head + body[:10])
        time.sleep(BODY_TIMEOUT_S / 2)
        slow_in_time.sendall(body[10:])
        slow_in_time.settimeout(30)
        assert slow_in_time.recv(4096).startswith(b"HTTP/1.1 200")
    assert post(url, "/v1/completions", completion()).status_code == 200
    record(
        "a REST client sends its headers, then its body a byte at a time",
        f"the body must be in within --http-body-timeout ({BODY_TIMEOUT_S:g} s here, 30 s by default) of the "
        "headers: 408 in OpenAI's shape and the connection closed; a slow body in time is served",
        "test_a_body_sent_a_byte_at_a_time_is_cut_off",
        f"cut after {cut_s:.2f}s ({sent} of {len(body)} bytes sent); the gateway kept serving",
    )


# ---- request ids -------------------------------------------------------------------------------------------
BAD_IDS = {
    "a newline": "job\n42",
    "NUL": "job\x0042",
    "non-ASCII": "caf\u00e9",
    "a space": "job 42",
    "129 characters": "x" * 129,
    "5,000 characters": "x" * 5000,
}


def generate_request(request_id: str = "", **fields) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(model=MODEL_ID, request_id=request_id, **fields)
    request.sampling.max_tokens = request.sampling.max_tokens or 2
    return request


def refused(stub, request, metadata=()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, metadata=metadata, timeout=30))
    return e.value


def test_a_request_id_the_mesh_cannot_carry_is_refused_at_the_edge(mesh, stub):
    """The review: ids with a newline, NUL or non-ASCII left the call open for ever (the router could not put them
    in its own calls' metadata), and a 5,000-character id made the prefill worker's done notice too long to send,
    so the request's prefill slots stayed held while it streamed."""
    started = time.monotonic()
    for name, rid in BAD_IDS.items():
        e = refused(stub, generate_request(rid, text="x"))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("request_id must"), (name, e)
        with pytest.raises(grpc.RpcError) as abort:
            stub.Abort(common_pb2.AbortRequest(request_id=rid, abort_token=b"\0" * 32), timeout=10)
        assert abort.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
    for rid in ("job 42", "x" * 5000):  # in metadata (gRPC itself will not send the others there)
        e = refused(stub, generate_request(text="x"), metadata=(("x-request-id", rid),))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("request_id must"), e
    refused_s = time.monotonic() - started
    longest = "~" * 128  # the longest id taken is served end to end, and every slot comes back
    replies = list(stub.Generate(generate_request(longest, text="x"), timeout=30))
    assert {r.request_id for r in replies} == {longest} and replies[-1].delta.finished
    assert mesh.wait_idle() == {}
    record(
        "gRPC request ids with a newline, NUL, non-ASCII or a space, or of 129 and 5,000 characters (field or "
        "metadata); Abort with such an id",
        "INVALID_ARGUMENT at once (1 to 128 printable ASCII characters, no spaces), so no call is left open and no "
        "done notice outgrows its 4 KiB",
        "test_a_request_id_the_mesh_cannot_carry_is_refused_at_the_edge",
        f"all {len(BAD_IDS) * 2 + 2} calls refused in {refused_s:.2f}s; a 128-character id served, every worker idle "
        "after",
    )


# ---- one rule for both edges -------------------------------------------------------------------------------
def test_grpc_is_held_to_every_limit_rest_is_held_to_in_the_same_words(mesh, url, stub):
    stop = common_pb2.StopConditions
    cases = [  # (REST fields, gRPC fields, the parameter REST names)
        (dict(stop=["a"] * 17), dict(stop=stop(stop=["a"] * 17)), "stop"),
        (dict(stop="x" * 2000), dict(stop=stop(stop=["x" * 2000])), "stop"),
        (dict(stop=["x" * 1000] * 5), dict(stop=stop(stop=["x" * 1000] * 5)), "stop"),
        (dict(stop_token_ids=[1] * 1025), dict(stop=stop(stop_token_ids=[1] * 1025)), "stop_token_ids"),
        (dict(stop_token_ids=[10**6]), dict(stop=stop(stop_token_ids=[10**6])), "stop_token_ids"),
    ]
    for rest, grpc_fields, param in cases:
        r = post(url, "/v1/completions", completion(**rest))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        e = refused(stub, generate_request(text="x", **grpc_fields))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details() == r.json()["error"]["message"], e
    messages = [router_pb2.ChatMessage(role="user", content="x")] * 4097
    r = post(url, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x"}] * 4097))
    e = refused(stub, generate_request(chat=router_pb2.ChatMessages(messages=messages)))
    assert r.json()["error"]["param"] == "messages" and e.details() == r.json()["error"]["message"], (r.text, e)
    long_role = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="r" * 100_000, content="hi")])
    e = refused(stub, generate_request(chat=long_role))  # REST's schema takes OpenAI's roles only; so does gRPC
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "role must be one of" in e.details(), e
    # a request over 4 MiB is refused unread on both edges
    assert post(url, "/v1/completions", completion(prompt="x" * (5 << 20))).status_code == 413
    assert refused(stub, generate_request(text="x" * (5 << 20))).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert mesh.wait_idle() == {}


def peak_rss(pid: int) -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) << 10


@pytest.mark.alone  # bounds wall-clock times
def test_huge_grpc_stop_strings_neither_stall_streams_nor_grow_the_router(mesh):
    """The review: six gRPC requests with 16 x 3.9 MB stop strings stalled other streams for up to 8 s and took the
    router from 334 MB to 2.76 GB. Sent again beside 4 streams, then six whose stop strings fit the request cap
    (16 x 250,000 characters), which the stop-string rule refuses."""
    router = mesh.procs[0].popen.pid
    # serialised before the streams' pace is measured: in this process, that is seconds of work under the GIL,
    # which would stall the threads that time the streams, not the router
    messages = {
        chars: generate_request(text="x", stop=common_pb2.StopConditions(stop=["s" * chars] * 16)).SerializeToString()
        for chars in (3_900_000, 250_000)
    }

    def attack(chars: int) -> grpc.StatusCode:
        with grpc.insecure_channel(mesh.router_address) as channel:
            generate = channel.unary_stream("/deltamesh.v1.Router/Generate")  # bytes as they are
            with pytest.raises(grpc.RpcError) as e:
                list(generate(messages[chars], timeout=60))
        return e.value.code()

    with mesh.client(retries=0) as client:
        streams = [TimedStream(client, f"Story number {i}:") for i in range(4)]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while min(len(s.arrivals) for s in streams) < 30 and time.monotonic() < deadline:  # warm-up
            time.sleep(0.05)
        quiet_start = time.monotonic()
        time.sleep(2.0)
        quiet = max(s.max_gap(quiet_start, time.monotonic()) for s in streams)
        peak_before = peak_rss(router)
        codes, gaps = {}, {}
        for chars in messages:
            start = time.monotonic()
            with ThreadPoolExecutor(6) as pool:
                codes[chars] = set(pool.map(attack, [chars] * 6))
            time.sleep(0.3)
            gaps[chars] = max(s.max_gap(start, time.monotonic()) for s in streams)
        for s in streams:
            s.stream.cancel()
        for s in streams:
            s.join(10)
    grown = peak_rss(router) - peak_before
    record(
        "six gRPC requests with 16 x 3.9 MB stop strings, then six with 16 x 250,000 characters, beside 4 streams",
        "the first refused unread (RESOURCE_EXHAUSTED: over the 4 MiB request cap, as REST's body cap), the "
        "others with INVALID_ARGUMENT (REST's stop-string limits); streams keep their pace; the router does not grow",
        "test_huge_grpc_stop_strings_neither_stall_streams_nor_grow_the_router",
        f"largest inter-token gap {gaps[3_900_000] * 1000:.0f} ms while the 374 MB went through loopback, "
        f"{gaps[250_000] * 1000:.0f} ms for the others (without an attack {quiet * 1000:.0f} ms); the router's peak "
        f"memory grew by {grown / 2**20:.0f} MiB",
    )
    assert codes == {3_900_000: {grpc.StatusCode.RESOURCE_EXHAUSTED}, 250_000: {grpc.StatusCode.INVALID_ARGUMENT}}
    # The review's stall was 8 s. Refused messages still cross loopback (374 MB on the same two cores: about
    # 0.3 s of stall measured); messages the router reads stall streams no more than the other edge attacks.
    assert gaps[3_900_000] < 1.0 + 5 * quiet and gaps[250_000] < 0.2 + 5 * quiet, (gaps, quiet)
    # the review measured +2.4 GB; six 4 MB messages in flight at once account for tens of MB
    assert grown < 256 << 20, f"router peak memory grew by {grown / 2**20:.0f} MiB"
    assert mesh.wait_idle(timeout=15) == {}


# ---- fair admission ----------------------------------------------------------------------------------------
def first_token_s(client) -> float:
    started = time.monotonic()
    with client.stream("Tell me a story", max_tokens=2, temperature=0, ignore_eos=True, timeout=300) as stream:
        next(iter(stream))
        return time.monotonic() - started


def test_one_request_of_1024_prompts_does_not_hold_back_other_clients(mesh, url):
    """The review: one REST request of 1,024 prompts (3.9 MB) pushed other clients' time to first token to 17.4 s:
    the workers serve in arrival order, and all 1,024 arrived at once. The router now starts a request's choices in
    turn, with at most --max-prefilling-tokens (4096) of its prompt tokens waiting for a first token at once
    (gateway/fanout.py), so another client's first token waits for about 4096 tokens' prefill at most. Measured on
    two busy cores (prefill at about 2,300 tokens/s): with all choices let in at once, the other client's first
    token waited for the whole batch (128 s); with 32 choices at a time, 20-47 s; with this bound, the figures in
    docs/RELIABILITY.md. The bound asserted, 10 s, is five times what 4096 tokens take there."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 85)[:3800]  # about 1k tokens, as the review's
    body = completion(prompt=[f"{i} {prompt}" for i in range(1024)], max_tokens=16, stream=True, ignore_eos=True)
    streamed = []  # SSE events of the big request, as they arrive
    with mesh.client(retries=0) as client:
        quiet = [first_token_s(client) for _ in range(5)]
        with httpx.Client(timeout=600) as http, http.stream("POST", f"{url}/v1/completions", json=body) as big:
            assert big.status_code == 200
            lines = big.iter_lines()

            def read():
                try:
                    for line in lines:
                        if line.startswith("data: {"):
                            streamed.append(time.monotonic())
                except httpx.HTTPError:  # closed when the test hangs up
                    pass

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            under = []
            for _ in range(8):
                under.append(first_token_s(client))
                time.sleep(0.5)
            served_meanwhile = len(streamed)
        reader.join(30)  # the big request hung up: it ends, and every choice of it leaves the mesh
    record(
        "one REST request of 1,024 prompts (3.9 MB, 16 tokens each) while another client asks for first tokens",
        "a request's choices start in turn, at most --max-prefilling-tokens (4096) of its prompt tokens waiting for "
        "a first token at once: the other client waits for about that much prefill, not for the whole batch",
        "test_one_request_of_1024_prompts_does_not_hold_back_other_clients",
        f"other client's TTFT {statistics.median(quiet) * 1000:.0f} ms alone (median), under the big request "
        f"median {statistics.median(under) * 1000:.0f} ms, worst {max(under):.2f}s; the big request streamed "
        f"{served_meanwhile} chunks meanwhile",
    )
    assert max(under) < 10.0, f"first tokens under the big request: {under} (alone: {quiet})"
    assert served_meanwhile > 0  # and the big request was served meanwhile, not starved
    assert mesh.wait_idle(timeout=60) == {}

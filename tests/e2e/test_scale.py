"""A router of two processes sharing its ports (--api-server-count 2), against real workers: concurrent streams through
both give the monolithic engine's outputs, workers that registered with one process serve both, cache-aware routing
sends a repeated prefix to the same worker from either process, and `serve` replaces a killed router process while
the other keeps serving.

Which process a request reaches is the kernel's choice (SO_REUSEPORT spreads connections); a test that needs one
opens HTTP connections until /ready, which names the process that answered, says it reached that one, and sends
its request on that connection."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import READY_TIMEOUT_S, ROOT, free_port, start_mesh
from test_supervisor import environ

from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.services.common.auth import MESH_SECRET_ENV
from deltamesh.services.common.options import SETTINGS_ENV
from deltamesh.services.router.control import read_loads

pytestmark = [pytest.mark.e2e, pytest.mark.scale]
MODEL = str(DEFAULT_MODEL)
# a SIGKILLed router process serves again within this: a process start (imports, the tokenizer), bounded for a
# 2-core machine shared with other work, where a start can take ten times its idle-machine seconds
RESTART_BOUND_S = 180.0


def on_process(http_port: int, process: int, attempts: int = 200) -> httpx.Client:
    """An HTTP client whose one keep-alive connection reached router process `process`."""
    for _ in range(attempts):
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{http_port}",
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=120,
        )
        try:
            if client.get("/ready").json().get("process") == process:
                return client
        except httpx.HTTPError:
            pass
        client.close()
    raise AssertionError(f"no connection reached router process {process} in {attempts} tries")


def stream_text(client: httpx.Client, prompt: list[int], max_tokens: int, on_first=None) -> str:
    """A streamed completion's text (`on_first()` called once its first chunk is in)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    text = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += [c["text"] for c in chunk["choices"]]
                if on_first is not None and len(text) == 1:
                    on_first()
    return "".join(text)


def prompts(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def loads_of(mesh, process: int):
    host, port = mesh.control_address.rsplit(":", 1)
    return read_loads(f"{host}:{int(port) + process}", mesh.secret)


def wait_for(condition, what: str, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """Two router processes; two prefill workers and a decode worker, each told only process 1's control plane."""
    m = start_mesh(
        MODEL, tmp_path_factory.mktemp("scale"), prefill=0, decode=0, router_args=["--api-server-count", "2"], http=True
    )
    host, port = m.control_address.rsplit(":", 1)
    m.control_address = f"{host}:{int(port) + 1}"  # the address the workers are given
    try:
        for role in ("prefill", "prefill", "decode"):
            m.start_worker(role, ["--prefix-cache"])
        m.control_address = f"{host}:{port}"
        m.wait_ready()  # as process 0 sees them: workers that registered with process 1 only
    except BaseException:
        m.stop()
        raise
    yield m
    m.stop()


def test_workers_that_registered_with_one_process_serve_through_both(mesh):
    for process in (0, 1):
        assert sorted(w.role for w in loads_of(mesh, process) if w.healthy) == ["decode", "prefill", "prefill"]
    for w in mesh.workers():
        log = w.log.read_text()
        host, port = mesh.control_address.rsplit(":", 1)
        for p in (int(port), int(port) + 1):  # the first told it of the second
            assert f'"router": "{host}:{p}"' in log and "registered with router" in log, log[-2000:]
    for process in (0, 1):
        with contextlib.closing(on_process(mesh.http_port, process)) as client:
            assert stream_text(client, [5, 6, 7, 8], 4)


def test_two_router_processes_stream_concurrently_with_the_engines_outputs(mesh, reference_engine):
    batch = prompts(12, [3, 40, 90, 170], seed=7)
    expected = [
        o.text for o in reference_engine.generate(batch, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    ]
    clients = [on_process(mesh.http_port, i % 2) for i in range(4)]  # two connections on each process
    got = [None] * len(batch)

    def run(lane: int) -> None:
        for i in range(lane, len(batch), len(clients)):
            got[i] = stream_text(clients[lane], batch[i], 16)

    threads = [threading.Thread(target=run, args=(lane,)) for lane in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    assert got == expected
    assert mesh.wait_idle() == {}


def test_a_repeated_prefix_goes_to_the_same_worker_from_either_process(mesh, reference_engine):
    system = prompts(1, [120], seed=11)[0]  # 7 whole blocks of 16 tokens shared by every turn
    turns = [system + tail for tail in prompts(4, [5, 9, 14, 20], seed=12)]
    expected = [
        o.text for o in reference_engine.generate(turns, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ]
    prefill = mesh.workers("prefill")
    hits0 = {p.address: p.load().prefix_cache_hit_tokens for p in prefill}
    # what each process knew before: the workers already hold earlier tests' prefixes
    known0 = [{w.address: w.prefixes for w in loads_of(mesh, i) if w.role == "prefill"} for i in (0, 1)]
    with contextlib.closing(on_process(mesh.http_port, 0)) as client:
        assert stream_text(client, turns[0], 6) == expected[0]

    def both_know_the_new_holder() -> bool:  # the holder's report of this prompt's prefix reached each index
        grown = [
            {w.address for w in loads_of(mesh, i) if w.role == "prefill" and w.prefixes > known0[i].get(w.address, 0)}
            for i in (0, 1)
        ]
        return bool(grown[0] & grown[1])

    wait_for(both_know_the_new_holder, "both router processes know which worker holds the prefix")
    for turn, process in zip(range(1, 4), (1, 0, 1)):
        with contextlib.closing(on_process(mesh.http_port, process)) as client:
            assert stream_text(client, turns[turn], 6) == expected[turn]
    gained = sorted(p.load().prefix_cache_hit_tokens - hits0[p.address] for p in prefill)
    assert gained[0] == 0 and gained[1] >= 3 * 112  # every later turn, from either process, on the one worker


class Serve:
    """`deltamesh serve --api-server-count 2` (1 prefill + 1 decode) and its processes."""

    def __init__(self, log_dir):
        self.control_port, self.http_port = free_port(), free_port()
        self.secret = os.urandom(16).hex()
        self.log = log_dir / "serve.log"
        argv = [sys.executable, "-m", "deltamesh.services.cli", "serve", "--api-server-count", "2"]
        argv += ["--grpc-port", str(free_port()), "--control-port", str(self.control_port)]
        argv += ["--http-port", str(self.http_port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", MESH_SECRET_ENV: self.secret}
        self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def routers(self) -> dict[int, int]:
        """process number -> pid of the router processes running now."""
        out = {}
        for task in os.scandir(f"/proc/{self.popen.pid}/task"):
            for pid in Path(task.path, "children").read_text().split():
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    settings = json.loads(environ(int(pid)).get(SETTINGS_ENV, "{}"))
                except OSError:
                    continue
                if len(argv) > 3 and argv[3] == b"router":
                    out[settings["process_index"]] = int(pid)
        return out

    def serving(self, process: int) -> bool:
        """Process `process` sees both workers healthy."""
        try:
            loads = read_loads(f"127.0.0.1:{self.control_port + process}", self.secret, timeout=2)
        except Exception:
            return False
        return sorted(w.role for w in loads if w.healthy) == ["decode", "prefill"]

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(60)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def test_serve_replaces_a_killed_router_process_while_the_other_keeps_serving(tmp_path, reference_engine):
    serve = Serve(tmp_path)
    try:
        wait_for(lambda: serve.serving(0) and serve.serving(1), f"serve ready:\n{serve.log.read_text()[-3000:]}")
        prompt = prompts(1, [30], seed=21)[0]
        expected = reference_engine.generate([prompt], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
        victim = serve.routers()[1]
        results = {}

        def kill_the_other() -> None:
            os.kill(victim, signal.SIGKILL)
            results["killed_at"] = time.monotonic()

        with contextlib.closing(on_process(serve.http_port, 0)) as client:  # a stream on process 0 while process 1 dies
            results["text"] = stream_text(client, prompt, 120, on_first=kill_the_other)
        assert "killed_at" in results
        assert results["text"] == expected[0].text
        with httpx.Client(base_url=f"http://127.0.0.1:{serve.http_port}", timeout=120) as client:  # new connections
            assert stream_text(client, prompt[:10], 4)
        wait_for(
            lambda: serve.routers().get(1, victim) != victim and serve.serving(1),
            f"router process 1 back:\n{serve.log.read_text()[-3000:]}",
            RESTART_BOUND_S,
        )
        with contextlib.closing(on_process(serve.http_port, 1)) as client:
            assert (
                stream_text(client, prompt, 8)
                == reference_engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[
                    0
                ].text
            )
        assert "restarting router-1" in serve.log.read_text()
    finally:
        serve.stop()

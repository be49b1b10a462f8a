"""Start-up and shutdown as a new user meets them: requests sent before any worker is ready are held (bounded)
instead of failing at once, and the whole mesh stops quickly with every log line a JSON line."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from harness import READY_TIMEOUT_S, ROOT, Mesh, free_port

from deltamesh.engine import DEFAULT_MODEL

pytestmark = pytest.mark.e2e


def router_alone(tmp_path, ready_timeout_s: float) -> tuple[Mesh, str]:
    """A router with no worker yet, once its REST gateway answers; (the mesh, the gateway's URL)."""
    mesh = Mesh(str(DEFAULT_MODEL), tmp_path, router_args=["--ready-timeout", str(ready_timeout_s)])
    mesh.start_router(http=True)
    url = f"http://127.0.0.1:{mesh.http_port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return mesh, url
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)


def test_requests_wait_for_the_first_workers_then_get_503_with_retry_after(tmp_path):
    mesh, url = router_alone(tmp_path, READY_TIMEOUT_S)
    try:
        result = {}
        body = {"model": DEFAULT_MODEL.name, "prompt": "Early", "max_tokens": 3, "ignore_eos": True}
        early = threading.Thread(
            target=lambda: result.update(r=httpx.post(f"{url}/v1/completions", json=body, timeout=READY_TIMEOUT_S + 30))
        )
        early.start()
        time.sleep(0.5)
        mesh.start_worker("prefill")
        mesh.start_worker("decode")
        early.join(READY_TIMEOUT_S + 30)
        assert result["r"].status_code == 200, result["r"].text  # held until the workers were ready
        assert result["r"].json()["usage"]["completion_tokens"] == 3
    finally:
        mesh.stop()


def test_a_mesh_without_workers_answers_503_with_retry_after_naming_what_is_missing(tmp_path):
    mesh, url = router_alone(tmp_path, 1)
    try:
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": DEFAULT_MODEL.name, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        # held for the router's --ready-timeout (1 s here, 10 s by default) and no longer: the answer names the wait
        message = r.json()["error"]["message"]
        assert "no healthy workers" in message and "(waited 1 s)" in message and time.monotonic() - started > 0.9
        # with a prefill worker up, the answer names the role still missing (/ready says it too)
        mesh.start_worker("prefill")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "decode" not in (why := httpx.get(f"{url}/ready", timeout=5).json()["error"]["message"]):
            assert time.monotonic() < deadline, why
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json={"model": DEFAULT_MODEL.name, "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and "no healthy decode worker" in r.json()["error"]["message"], r.text
    finally:
        mesh.stop()


def test_serve_stops_quickly_and_logs_json_lines(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltamesh.services.cli",
            "serve",
            "--grpc-port",
            str(port),
            "--control-port",
            str(free_port()),
            "--http-port",
            str(free_port()),
        ],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        from deltamesh.client import Client

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                with Client(f"127.0.0.1:{port}", retries=0, timeout=30) as client:
                    assert client.generate("Hello", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
                break
            except Exception:
                assert time.monotonic() < deadline and serve.poll() is None, log.read_text()[-3000:]
                time.sleep(0.5)
        # one line tells the user the mesh can serve (every worker registered and healthy)
        while "deltamesh: mesh ready (1 prefill + 1 decode): gRPC" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        stopping = time.monotonic()
        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        stop_s = time.monotonic() - stopping
    finally:
        if serve.poll() is None:
            serve.kill()
    print(f"\nserve stopped {stop_s:.2f} s after SIGINT")
    bad = []
    for line in log.read_text().splitlines():
        if line.startswith(("deltamesh:", "DELTAMESH_READY")):  # serve's own lines and the readiness markers
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError:
            bad.append(line)
    assert not bad, bad[:5]
    # quickly: serve stopped each of its three children, on its own after SIGTERM ("stopped after": about a second
    # on an idle machine) or at serve's 10 s deadline ("killing": a machine shared with other work got there once),
    # and exited 0 within 60 s (above)
    own = [line for line in log.read_text().splitlines() if line.startswith("deltamesh:")]
    ended = sum("stopped after" in line or line.startswith("deltamesh: killing") for line in own)
    assert ended == 3, own

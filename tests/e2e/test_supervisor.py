"""`deltamesh serve` supervises its processes: a SIGKILLed worker is restarted on its own ports while the rest of
the mesh keeps serving, SIGINT stops everything with exit code 0 and leaves no process behind, and a process that
cannot start makes `serve` give up instead of restarting it forever. All against the real `serve` command."""

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import READY_TIMEOUT_S, ROOT, free_port
from reliability import record

from deltamesh.client import Client, DeltameshError
from deltamesh.services.common.auth import MESH_SECRET_ENV
from deltamesh.services.common.options import SETTINGS_ENV
from deltamesh.services.router.control import read_loads

pytestmark = [pytest.mark.e2e, pytest.mark.fault]  # processes killed and restarted: fault injection
# A killed worker's mesh serves again within 10 s on an idle machine (the bound; docs/RELIABILITY.md records
# the time measured: 5.5 to 6.5 s on 2 cores with nothing else running). Most of it is the new process's start
# (torch, the model), which on a 2-core machine shared with other work took over 60 s once; this bound tells a
# restart from none with room for that.
RESTART_BOUND_S = 120.0
# serve gives up after a process failed to start 5 times in a row, each a process start: 25 s on an idle machine
GIVE_UP_WITHIN_S = 480.0


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


class Serve:
    """A `deltamesh serve` process and what it started."""

    def __init__(self, log_dir: Path, prefill: int, decode: int, grpc_port: int | None = None, env: dict | None = None):
        self.grpc_port, self.control_port = grpc_port or free_port(), free_port()
        self.secret = secrets.token_hex(16)  # given to serve, so that this test can read the router's loads
        self.log = log_dir / "serve.log"
        argv = [
            sys.executable,
            "-m",
            "deltamesh.services.cli",
            "serve",
            "--grpc-port",
            str(self.grpc_port),
            "--control-port",
            str(self.control_port),
            "--http-port",
            "0",
            "--prefill-workers",
            str(prefill),
            "--decode-workers",
            str(decode),
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", MESH_SECRET_ENV: self.secret, **(env or {})}
        self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.seen_pids: set[int] = set()  # every child ever started, for the orphan check

    def client(self) -> Client:
        return Client(f"127.0.0.1:{self.grpc_port}", retries=0, timeout=10)

    def children(self) -> dict[int, tuple[str, str]]:
        """pid -> (role, gRPC address of a worker or '' for the router), from /proc (no psutil here)."""
        out = {}
        for task in Path(f"/proc/{self.popen.pid}/task").glob("*"):
            try:
                pids = (task / "children").read_text().split()
            except OSError:  # the thread ended after the listing (it has no children then)
                continue
            for pid in pids:
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                    env = environ(int(pid))
                except OSError:  # exited meanwhile
                    continue
                if len(argv) < 4:  # a zombie (dead, not reaped yet) has no command line
                    continue
                port = json.loads(env.get(SETTINGS_ENV, "{}")).get("port")  # serve hands each child its settings
                out[int(pid)] = (argv[3], f"127.0.0.1:{port}" if argv[3] != "router" else "")
        self.seen_pids |= out.keys()
        return out

    def pids(self, role: str) -> list[int]:
        return [pid for pid, (r, _) in self.children().items() if r == role]

    def healthy(self) -> set[str]:
        try:
            return {w.address for w in read_loads(f"127.0.0.1:{self.control_port}", self.secret) if w.healthy}
        except grpc.RpcError:
            return set()

    def wait_ready(self, workers: int, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, f"serve exited:\n{self.log.read_text()[-3000:]}"
            if len(self.healthy()) == workers and self.generates():
                return
            time.sleep(0.2)
        raise TimeoutError(f"mesh not ready after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def generates(self) -> bool:
        try:
            with self.client() as c:
                return c.generate("Hello", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        except DeltameshError:
            return False

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        try:
            return self.popen.wait(60)  # serve's own stop: SIGTERM, then SIGKILL 10 s on
        finally:
            for pid in self.pids_left():  # never leave a mesh behind, even when the test failed
                os.kill(pid, signal.SIGKILL)
            if self.popen.poll() is None:
                self.popen.kill()

    def pids_left(self) -> list[int]:
        """Processes still running a command line of this mesh (its secret is in every one's environment)."""
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            pid = int(cmdline.parent.name)
            try:
                ours = (
                    b"deltamesh.services.cli" in cmdline.read_bytes()
                    and environ(pid).get(MESH_SECRET_ENV) == self.secret
                )
            except OSError:
                continue
            if ours:
                left.append(pid)
        return [pid for pid in left if pid != self.popen.pid]


class Traffic:
    """Requests sent one after another from a thread; records when each ended and whether it succeeded."""

    def __init__(self, serve: Serve):
        self.serve, self.results, self.done = serve, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            ok = self.serve.generates()
            self.results.append((time.monotonic(), ok))
            if not ok:
                time.sleep(0.05)

    def stop(self):
        self.done.set()
        self.thread.join(30)

    def between(self, start: float, end: float) -> tuple[int, int]:
        """(succeeded, failed) of the requests that ended in [start, end)."""
        ended = [ok for at, ok in self.results if start <= at < end]
        return sum(ended), len(ended) - sum(ended)


def answers_health(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def kill_and_wait_back(serve: Serve, role: str, workers: int) -> float:
    """SIGKILL the first worker of `role`; seconds until a new process of that role serves on the same address,
    the router sees every worker healthy, and a request through the router succeeds after that."""
    (pid, address), *_ = [(p, a) for p, (r, a) in serve.children().items() if r == role]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < RESTART_BOUND_S:
        back = [p for p, (r, a) in serve.children().items() if r == role and a == address and p != pid]
        if back and answers_health(address) and len(serve.healthy()) == workers and serve.generates():
            return time.monotonic() - killed_at
        time.sleep(0.1)
    raise TimeoutError(f"{role} at {address} not back after {RESTART_BOUND_S:g} s:\n{serve.log.read_text()[-3000:]}")


def test_killed_workers_are_restarted_while_the_mesh_serves(tmp_path):
    serve = Serve(tmp_path, prefill=1, decode=2)
    try:
        serve.wait_ready(workers=3)
        traffic = Traffic(serve)
        time.sleep(1)

        decode_killed_at = time.monotonic()
        decode_s = kill_and_wait_back(serve, "decode", workers=3)
        prefill_killed_at = time.monotonic()
        prefill_s = kill_and_wait_back(serve, "prefill", workers=3)
        traffic.stop()
        decode_ok, decode_failed = traffic.between(decode_killed_at, decode_killed_at + decode_s)
        prefill_ok, prefill_failed = traffic.between(prefill_killed_at, prefill_killed_at + prefill_s)
        print(
            f"\ndecode worker SIGKILLed: serving again (restarted, healthy, generating) after {decode_s:.2f} s; "
            f"requests meanwhile: {decode_ok} ok, {decode_failed} failed"
        )
        print(
            f"only prefill worker SIGKILLed: serving again after {prefill_s:.2f} s; "
            f"requests meanwhile: {prefill_ok} ok, {prefill_failed} failed"
        )
        record(
            "`deltamesh serve` (1 prefill, 2 decode): a decode worker, then the only prefill worker SIGKILLed",
            "serve restarts each on its own ports (back-off from 0.5 s); the other decode worker keeps serving; "
            "the mesh serves again within 10 s",
            "test_killed_workers_are_restarted_while_the_mesh_serves",
            f"serving again {decode_s:.2f}s after the decode kill ({decode_ok} requests ok, {decode_failed} failed "
            f"meanwhile) and {prefill_s:.2f}s after the prefill kill",
        )
        assert serve.popen.poll() is None, "serve exited after a worker was killed"
        assert decode_s < RESTART_BOUND_S and prefill_s < RESTART_BOUND_S
        assert decode_ok > 0, "the other decode worker should have served while its peer was down"
        log = serve.log.read_text()
        assert "decode-0 killed by SIGKILL" in log and "prefill-0 killed by SIGKILL" in log, log[-3000:]
    finally:
        stop_started = time.monotonic()
        code = serve.stop()
    print(f"SIGINT stopped the mesh in {time.monotonic() - stop_started:.2f} s")
    assert code == 0, serve.log.read_text()[-3000:]
    assert serve.pids_left() == [], "processes of the mesh outlived serve"
    assert all(not Path(f"/proc/{pid}").exists() for pid in serve.seen_pids)


# Ctrl-C on serve: its children stop gracefully in parallel and every process leaves without the interpreter's
# teardown; 0.5-0.7 s measured on the shared 2-core machine after a restart (it was 7-12 s: grpc.aio's and torch's
# objects garbage-collected at exit). The bound, over 4x the measured time.
STOP_BOUND_S = 3.0


@pytest.mark.alone  # bounds wall-clock times
def test_ctrl_c_stops_serve_quickly_after_a_worker_was_restarted(tmp_path):
    serve = Serve(tmp_path, prefill=1, decode=1)
    try:
        serve.wait_ready(workers=2)
        kill_and_wait_back(serve, "decode", workers=2)
        serve.popen.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = serve.popen.wait(60)
        stop_s = time.monotonic() - started
    finally:
        serve.stop()
    print(f"SIGINT stopped serve in {stop_s:.2f} s after a restarted worker")
    assert code == 0 and stop_s < STOP_BOUND_S, serve.log.read_text()[-3000:]
    assert serve.pids_left() == []


def test_serve_gives_up_on_a_process_that_cannot_start(tmp_path):
    # a setting only the router reads is bad: the router fails every start, serve itself starts fine
    serve = Serve(tmp_path, prefill=1, decode=1, env={"DELTAMESH_MAX_PROMPTS": "not-a-number"})
    started = time.monotonic()
    try:
        code = serve.popen.wait(GIVE_UP_WITHIN_S)
    finally:
        serve.stop()
    print(f"\nserve gave up after {time.monotonic() - started:.1f} s with exit code {code}")
    log = serve.log.read_text()
    assert code != 0
    assert "router exited with status 2 5 times in a row" in log, log[-3000:]
    assert "giving up and stopping the mesh" in log
    assert serve.pids_left() == []


def test_a_killed_serve_leaves_no_process_behind(tmp_path):
    """SIGKILL of serve itself (no chance to stop its children): each child gets SIGTERM from the kernel and stops,
    so that no worker holds the mesh's ports for a next `serve`."""
    serve = Serve(tmp_path, prefill=1, decode=1)
    try:
        serve.wait_ready(workers=2)
        assert len(serve.children()) == 3
        serve.popen.kill()
        serve.popen.wait(10)
        deadline = time.monotonic() + 120  # a poll: the children's own stop, slow only on a loaded machine
        while serve.pids_left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert serve.pids_left() == [], "children of a SIGKILLed serve kept running"
    finally:
        serve.stop()

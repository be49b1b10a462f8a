"""Start the real services as processes on free loopback ports (no mocked gRPC or UCX)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deltamesh.client import Client
from deltamesh.services.common.auth import MESH_SECRET_ENV, mesh_metadata
from deltamesh.services.common.ports import free_port
from deltamesh.services.router.control import read_loads
from deltamesh.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.e2e.zygote import ForkedProcess, zygote

ROOT = Path(__file__).resolve().parents[2]
# How long the harness waits for what a mesh does in its own time. Generous, and only paid when something is
# wrong: make test runs meshes side by side on a 2-core machine that other work shares, where a process start
# (torch, the model) can take ten times its idle-machine seconds.
READY_TIMEOUT_S = 240.0  # every worker registered and healthy (process start, model load)
IDLE_TIMEOUT_S = 30.0  # every pool and lease back to zero after the last request
CALL_TIMEOUT_S = 15.0  # a GetLoads call to a worker busy with its engine steps


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the mesh secret) to every call on a channel, as the router's own calls carry it."""

    def __init__(self, pairs):
        self.pairs = tuple(pairs)

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.pairs)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def bench_rows(script: str, args: list[str], out: Path, timeout: float) -> list[dict]:
    """Run bench/`script` with `args` and `--out out` from the repository root; the rows of the JSON it wrote
    (the run's output in the failure message when it did not exit 0)."""
    run = subprocess.run(
        [sys.executable, f"bench/{script}", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def channel(address: str, credentials: grpc.ChannelCredentials | None = None, secret: str | None = None):
    """A channel to one of the mesh's processes; with `secret`, every call carries the mesh secret."""
    ch = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    return grpc.intercept_channel(ch, _WithMetadata(mesh_metadata(secret))) if secret else ch


@dataclass
class Proc:
    role: str
    address: str
    popen: subprocess.Popen | ForkedProcess
    log: Path
    credentials: grpc.ChannelCredentials | None = None  # for TLS meshes
    secret: str | None = None  # the mesh secret its calls carry
    extra: tuple[str, ...] = ()  # a worker's own arguments, to start it again on another port

    def alive(self) -> bool:
        return self.popen.poll() is None

    def lost_its_port(self) -> bool:
        """Exited because another process bound its port between free_port() and its own bind (tests run side
        by side and each picks ports at random)."""
        return not self.alive() and "Address already in use" in self.log.read_text()

    def stub(self, secret: str | None = ...):
        """A stub of this worker's service; its calls carry the mesh secret unless `secret` says otherwise."""
        ch = channel(self.address, self.credentials, self.secret if secret is ... else secret)
        return (prefill_pb2_grpc.PrefillWorkerStub if self.role == "prefill" else decode_pb2_grpc.DecodeWorkerStub)(ch)

    def load(self) -> common_pb2.WorkerLoad:
        return self.stub().GetLoads(common_pb2.GetLoadsRequest(), timeout=CALL_TIMEOUT_S).workers[0]


@dataclass
class Mesh:
    model: str
    log_dir: Path
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    client_kwargs: dict = field(default_factory=dict)  # e.g. TLS credentials for the SDK client
    procs: list[Proc] = field(default_factory=list)
    router_address: str = ""  # the client API
    control_address: str = ""  # the control plane
    http_port: int = 0
    secret: str = field(default_factory=lambda: secrets.token_hex(16))  # this mesh's, given to every process
    # Workers forked from a process with torch imported (tests/e2e/zygote.py: a start without torch's import), or
    # started with exec as a user starts them: for tests that read what exec puts in a process (its environment
    # strings). Routers are always started with exec: tests read that none has torch mapped.
    forked_workers: bool = True

    def _spawn(self, role: str, args: list[str], port: int) -> Proc:
        log = self.log_dir / f"{role}-{port}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", MESH_SECRET_ENV: self.secret}
        popen: subprocess.Popen | ForkedProcess
        if role != "router" and self.forked_workers:
            popen = zygote(ROOT).start([role, *args], env, ROOT, log)
        else:
            popen = subprocess.Popen(
                [sys.executable, "-m", "deltamesh.services.cli", role, *args],
                cwd=ROOT,
                env=env,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )
        creds = None
        if self.client_kwargs.get("root_certificates"):
            kw = self.client_kwargs
            creds = grpc.ssl_channel_credentials(
                kw["root_certificates"], kw.get("private_key"), kw.get("certificate_chain")
            )
        proc = Proc(role, f"127.0.0.1:{port}", popen, log, creds, self.secret)
        self.procs.append(proc)
        return proc

    def start_router(self, http: bool = False, port: int | None = None, control_port: int | None = None) -> Proc:
        """The router; `port` / `control_port` to start one again where the last one was."""
        port, control_port = port or free_port(), control_port or free_port()
        self.http_port = free_port() if http else 0
        self.router_address, self.control_address = f"127.0.0.1:{port}", f"127.0.0.1:{control_port}"
        return self._spawn(
            "router",
            [
                "--model",
                self.model,
                "--grpc-port",
                str(port),
                "--control-port",
                str(control_port),
                "--http-port",
                str(self.http_port),
                *self.router_args,
            ],
            port,
        )

    def start_worker(self, role: str, extra: list[str] = ()) -> Proc:
        port = free_port()
        args = [
            "--model",
            self.model,
            "--port",
            str(port),
            "--router",
            self.control_address,
            "--torch-threads",
            "1",
            *self.worker_args,
            *extra,
        ]
        proc = self._spawn(role, args, port)
        proc.extra = tuple(extra)
        return proc

    def start_unregistered(self, role: str, timeout: float = READY_TIMEOUT_S) -> Proc:
        """A worker no router is told of (no --router), once it serves; started again on another port if another
        test took its port, as wait_ready does for registered ones."""
        deadline = time.monotonic() + timeout
        while True:
            port = free_port()
            proc = self._spawn(role, ["--model", self.model, "--port", str(port), "--torch-threads", "1"], port)
            while proc.alive() and time.monotonic() < deadline:
                try:
                    proc.load()
                    return proc
                except grpc.RpcError:  # not serving yet
                    time.sleep(0.2)
            if not proc.lost_its_port():
                raise RuntimeError(f"{role} worker not serving:\n{proc.log.read_text()[-3000:]}")
            self.procs.remove(proc)

    def client(self, **kwargs) -> Client:
        return Client(self.router_address, **{**self.client_kwargs, **kwargs})

    def loads(self, timeout: float = CALL_TIMEOUT_S) -> list[common_pb2.WorkerLoad]:
        """Every worker's load as the router sees it (its control plane, with the mesh secret)."""
        return read_loads(self.control_address, self.secret, self.procs[0].credentials if self.procs else None, timeout)

    def workers(self, role: str | None = None) -> list[Proc]:
        return [p for p in self.procs if p.role != "router" and (role is None or p.role == role) and p.alive()]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the router sees every live worker healthy. A worker that lost its port to another test is
        started again on another (the same Proc, now there); one that exits with an error fails the wait at once,
        with its log."""
        waiting = self.workers()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if not p.alive() and p.role == "router":
                    raise RuntimeError(f"router exited:\n{p.log.read_text()[-3000:]}")
            for p in list(waiting):
                if p.lost_its_port():  # started again on another port, in place: a test's reference follows it
                    again = self.start_worker(p.role, list(p.extra))
                    self.procs.remove(again)
                    vars(p).update(vars(again))
                elif not p.alive() and p.popen.returncode > 0:  # not a test's kill (a signal)
                    raise RuntimeError(f"{p.role} worker exited while starting:\n{p.log.read_text()[-3000:]}")
            want = {p.address for p in waiting}
            try:
                healthy = {w.address for w in self.loads() if w.healthy}
                if want <= healthy:
                    return
            except Exception:
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.log.name}\n{p.log.read_text()[-2000:]}" for p in self.procs)
        raise TimeoutError(f"mesh not ready after {timeout}s\n{logs}")

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> dict[str, common_pb2.WorkerLoad | str]:
        """Until every live worker reports no used pages, slots, held states, leases or reservations."""
        deadline = time.monotonic() + timeout
        while True:
            busy = {}
            for p in self.workers():
                try:
                    load = p.load()
                except grpc.RpcError as e:  # a worker too busy to answer in time is not idle yet
                    busy[p.address] = f"GetLoads: {e.code().name}"
                    continue
                if (
                    load.kv_pages_used
                    or load.state_slots_used
                    or load.held_states
                    or load.leases
                    or load.reservations
                    or load.running
                    or load.waiting
                ):
                    busy[p.address] = load
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.05)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        proc.popen.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.popen.wait(10)

    def stop(self) -> None:
        """Stop every process; fail if one of them crashed (a signal the tests never send: a segfault, an
        abort) at any point of the test, shutdown included."""
        for p in self.procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
        crashed = [
            f"{p.role} {p.address}: signal {-p.popen.returncode}, see {p.log}"
            for p in self.procs
            if p.popen.returncode is not None and -p.popen.returncode in _CRASH_SIGNALS
        ]
        assert not crashed, f"processes crashed: {crashed}"


_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


def start_mesh(
    model: str,
    log_dir: Path,
    prefill: int = 1,
    decode: int = 1,
    colocated: int = 0,
    worker_args: list[str] = (),
    router_args: list[str] = (),
    http: bool = False,
    client_kwargs: dict | None = None,
    role_args: dict[str, list[str]] | None = None,
    forked_workers: bool = True,
) -> Mesh:
    mesh = Mesh(
        model, log_dir, list(worker_args), list(router_args), client_kwargs or {}, forked_workers=forked_workers
    )
    mesh.start_router(http=http)
    for role, n in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
        for _ in range(n):
            mesh.start_worker(role, (role_args or {}).get(role, []))
    try:
        mesh.wait_ready()
    except BaseException:
        mesh.stop()
        raise
    return mesh

"""The mesh across hosts, on one machine: the router, a prefill worker and a decode worker each on a host of its
own (a network namespace joined by a veth pair to a bridge in a fourth namespace, the switch; and IPC, PID, mount
and UTS namespaces, so that no shared memory or CMA joins them either), so that every byte between them crosses a
network interface: gRPC between addresses, workers registering under --advertise-host, the UCX side channel over
TCP (--side-channel-interface). The test process reaches the mesh through a veth of its own. Needs root, iproute2
(`ip`, `tc`) and util-linux's `unshare`; skipped, saying why, where they or namespaces are missing.

Checked: greedy output token for token against the monolithic engine, the state's bytes counted on the prefill
host's interface, pull times (with DELTAMESH_PULL_TIMES_OUT=FILE they are written there as JSON: make
bench-multihost), and a prefill host cut off (link down) in the middle of a pull: the request ends with an error,
the decode worker frees what it reserved, the prefill worker its lease, and the mesh serves again once the link
is back."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from harness import start_mesh

from deltamesh.client import Client
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.services.common.auth import MESH_SECRET_ENV
from deltamesh.services.common.ports import free_port
from deltamesh.services.router.control import read_loads

pytestmark = [pytest.mark.e2e, pytest.mark.multihost]
ROOT = Path(__file__).resolve().parents[2]
ROUTER_PORT, CONTROL_PORT, HTTP_PORT, WORKER_PORT, METRICS_PORT = 50051, 50052, 8000, 50060, 9090
LEASE_TTL_S, TRANSFER_TIMEOUT_S = 8.0, 6.0
# a prompt whose state takes seconds to cross a link held to LINK_RATE (about 2 KB of KV per token plus the GDN
# state, on the tiny model), so that the link can be cut in the middle of its pull
SLOW_PROMPT_TOKENS, LINK_RATE = 1500, "2mbit"
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
# the side channel across hosts: UCX over TCP on the host's interface
SIDE_CHANNEL = ["--side-channel-interface", "eth0"]


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")
    return result


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install iproute2 util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"dmprobe{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    host = Host(probe, "", "")
    isolated = run(*host.exec("true"), check=False)
    run("ip", "netns", "del", probe, check=False)
    if isolated.returncode:
        return f"a host's own namespaces could not be made: {isolated.stderr.strip()}"
    return None


def metric(url: str, name: str) -> float:
    """The Prometheus samples at `url` named `name` (with labels, or all label sets of a bare name) added up; 0
    when absent."""
    text = httpx.get(url, timeout=10).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return sum(float(v) for k, v in samples if k == name or ("{" not in name and k.startswith(name + "{")))


@dataclass
class Host:
    """A network namespace with one interface (eth0) on the switch's bridge."""

    name: str  # the namespace
    address: str
    port: str  # its veth's end on the switch

    def exec(self, *args: str) -> list[str]:
        """A command run on this host: in its network namespace, and in namespaces of its own for processes, IPC,
        mounts and the host name, with a /dev/shm of its own, so that nothing but the network joins two hosts (UCX
        would otherwise reach a peer on "another host" through shared memory or CMA). A SIGTERM to the command
        reaches the process."""
        setup = f'hostname {self.name} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.name,
            "unshare",
            "--uts",
            "--ipc",
            "--pid",
            "--mount",
            "--fork",
            "--mount-proc",
            "--kill-child=SIGTERM",
            "sh",
            "-c",
            setup,
            "sh",
            *args,
        ]

    def tx_bytes(self) -> int:
        out = run("ip", "-n", self.name, "-s", "-j", "link", "show", "eth0").stdout
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]


@dataclass
class Network:
    """The switch (a bridge in a namespace), the hosts on it, and the test process's own veth to it."""

    tag: str
    subnet: str  # the first three octets
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def switch(self) -> str:
        return f"dm{self.tag}sw"

    @property
    def local(self) -> str:
        return f"dm{self.tag}t"

    def create(self, roles: list[str]) -> None:
        run("ip", "netns", "add", self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        run("ip", "link", "add", self.local, "type", "veth", "peer", "name", "vt", "netns", self.switch)
        run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.local)
        run("ip", "link", "set", self.local, "up")
        run("ip", "-n", self.switch, "link", "set", "vt", "master", "br0", "up")
        for number, role in enumerate(roles, start=2):
            host = Host(f"dm{self.tag}{role[0]}", f"{self.subnet}.{number}", f"v{role[0]}")
            run("ip", "netns", "add", host.name)
            run(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                host.name,
                "type",
                "veth",
                "peer",
                "name",
                host.port,
                "netns",
                self.switch,
            )
            run("ip", "-n", host.name, "link", "set", "lo", "up")
            run("ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            run("ip", "-n", host.name, "link", "set", "eth0", "up")
            run("ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up")
            self.hosts[role] = host

    def cut(self, role: str, down: bool) -> None:
        """Pull the host's cable at the switch (or plug it back)."""
        run("ip", "-n", self.switch, "link", "set", self.hosts[role].port, "down" if down else "up")

    def limit(self, role: str, rate: str | None) -> None:
        """Hold the host's outgoing traffic to `rate` (tc's token bucket), or lift the limit."""
        name = self.hosts[role].name
        if rate:
            run(
                "ip",
                "netns",
                "exec",
                name,
                "tc",
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "16kb",
                "latency",
                "10s",
            )
        else:
            run("ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)

    def destroy(self) -> None:
        run("ip", "link", "del", self.local, check=False)
        for host in self.hosts.values():
            run("ip", "netns", "del", host.name, check=False)
        run("ip", "netns", "del", self.switch, check=False)


@dataclass
class NetnsMesh:
    """The router and one worker of each role, each process on its own host of `net`."""

    net: Network
    log_dir: Path
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, role: str) -> None:
        host = self.net.hosts[role]
        if role == "router":
            args = [
                "--host",
                "0.0.0.0",
                "--grpc-port",
                str(ROUTER_PORT),
                "--control-port",
                str(CONTROL_PORT),
                "--http-port",
                str(HTTP_PORT),
            ]
        else:
            args = [
                "--host",
                "0.0.0.0",
                "--advertise-host",
                host.address,
                "--port",
                str(WORKER_PORT),
                "--router",
                f"{self.net.hosts['router'].address}:{CONTROL_PORT}",
                "--metrics-port",
                str(METRICS_PORT),
                *SIDE_CHANNEL,
                "--torch-threads",
                "1",
                "--lease-ttl",
                str(LEASE_TTL_S),
                "--transfer-timeout",
                str(TRANSFER_TIMEOUT_S),
            ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", MESH_SECRET_ENV: self.secret}
        log = (self.log_dir / f"{role}.log").open("w")
        self.procs[role] = subprocess.Popen(
            host.exec(sys.executable, "-m", "deltamesh.services.cli", role, "--model", str(DEFAULT_MODEL), *args),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    @property
    def router(self) -> str:
        return f"{self.net.hosts['router'].address}:{ROUTER_PORT}"

    def loads(self) -> dict[str, object]:
        """Each worker's load, by role, as the router sees it."""
        by_address = {
            w.address: w for w in read_loads(f"{self.net.hosts['router'].address}:{CONTROL_PORT}", self.secret)
        }
        return {
            role: by_address.get(f"{host.address}:{WORKER_PORT}")
            for role, host in self.net.hosts.items()
            if role != "router"
        }

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} exited:\n{self.logs()}")
            try:
                if all(load is not None and load.healthy for load in self.loads().values()):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the mesh was not ready within {timeout} s:\n{self.logs()}")

    def metric(self, role: str, name: str) -> float:
        return metric(f"http://{self.net.hosts[role].address}:{METRICS_PORT}/metrics", name)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        """SIGTERM to each service itself (the first process of its host's PID namespace, which unshare waits
        for), then its exit; a service that died of a crash signal fails the test."""
        for proc in self.procs.values():
            if proc.poll() is None:
                children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                os.kill(int(children[0]) if children else proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()  # unshare: its child gets SIGTERM (--kill-child), then this waits no longer
                proc.wait(5)
        # unshare ends the way its child did: by the same signal
        crashed = {role: -p.returncode for role, p in self.procs.items() if -p.returncode in CRASH_SIGNALS}
        assert not crashed, f"services crashed (signal): {crashed}\n{self.logs()}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    if reason := namespaces_unavailable():
        pytest.skip(reason)
    tag = str(os.getpid() % 100000)
    net = Network(tag, f"10.213.{os.getpid() % 250}")
    try:
        net.create(["router", "prefill", "decode"])
        mesh = NetnsMesh(net, tmp_path_factory.mktemp("multihost"))
        for role in ("router", "prefill", "decode"):
            mesh.start(role)
        try:
            mesh.wait_ready()
            yield mesh
        finally:
            mesh.stop()
    finally:
        net.destroy()


def generate(mesh: NetnsMesh, prompt, max_tokens: int = 16):
    with Client(mesh.router) as client:
        return client.generate(prompt, max_tokens=max_tokens, temperature=0)


def test_three_hosts_give_the_monolithic_engines_tokens(mesh, reference_engine):
    """Every request crosses three hosts: the router's gRPC to each worker, and the state from the prefill host to
    the decode host over UCX's TCP, counted on the prefill host's interface."""
    pulls_before = mesh.metric("decode", 'deltamesh_transfers_total{outcome="ok"}')
    pulled_before = mesh.metric("decode", "deltamesh_transfer_bytes_sum")
    sent_before = mesh.net.hosts["prefill"].tx_bytes()
    prompts = ["The Python language", "A list is", "In this tutorial, we", "x " * 300]
    for prompt in prompts:
        reply = generate(mesh, prompt, max_tokens=20)
        ref = reference_engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0))[0]
        assert reply.token_ids == ref.token_ids and reply.text == ref.text, prompt[:40]
    pulls = mesh.metric("decode", 'deltamesh_transfers_total{outcome="ok"}') - pulls_before
    pulled = mesh.metric("decode", "deltamesh_transfer_bytes_sum") - pulled_before
    sent = mesh.net.hosts["prefill"].tx_bytes() - sent_before
    assert pulls == len(prompts), f"{pulls} pulls for {len(prompts)} requests"
    assert sent >= pulled > 0, f"the prefill host's interface sent {sent} bytes for {pulled} bytes of state pulled"
    # the REST gateway too, from the test's own host
    body = {"model": DEFAULT_MODEL.name, "prompt": prompts[0], "max_tokens": 20, "temperature": 0}
    rest = httpx.post(f"http://{mesh.net.hosts['router'].address}:{HTTP_PORT}/v1/completions", json=body, timeout=60)
    assert rest.json()["choices"][0]["text"] == generate(mesh, prompts[0], 20).text


PULL_LENGTHS = (16, 256, 1024, 2048)


def time_pulls(generate_fn, decode_metric, tokenizer, reps: int) -> list[dict]:
    """Each pull's time as the decode worker measures it (deltamesh_transfer_seconds), `reps` pulls per prompt
    length: prompts of that many tokens, one output token after the first (the pull happens before it)."""
    rows = []
    for tokens in PULL_LENGTHS:
        prompt = tokenizer.encode("x " * 4000)[:tokens]
        times, sizes = [], []
        for _ in range(reps):
            count = decode_metric("deltamesh_transfer_seconds_count")
            seconds, size = (
                decode_metric("deltamesh_transfer_seconds_sum"),
                decode_metric("deltamesh_transfer_bytes_sum"),
            )
            generate_fn(prompt, max_tokens=2)
            assert decode_metric("deltamesh_transfer_seconds_count") == count + 1, "not one pull per request"
            times.append(decode_metric("deltamesh_transfer_seconds_sum") - seconds)
            sizes.append(decode_metric("deltamesh_transfer_bytes_sum") - size)
        times.sort()
        rows.append(
            {
                "prompt_tokens": tokens,
                "bytes": sizes[0],
                "median_ms": round(1000 * times[len(times) // 2], 3),
                "min_ms": round(1000 * times[0], 3),
                "max_ms": round(1000 * times[-1], 3),
            }
        )
    return rows


def write_pull_times(where: str, rows: list[dict]) -> None:
    """Adds `where`'s rows to DELTAMESH_PULL_TIMES_OUT (JSON), when set: make bench-multihost, bench/RESULTS.md."""
    if out := os.environ.get("DELTAMESH_PULL_TIMES_OUT"):
        path = Path(out)
        data = json.loads(path.read_text()) if path.exists() else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**data, where: rows}, indent=2))


def test_pull_times_across_hosts(mesh, reference_engine):
    reps = 7 if os.environ.get("DELTAMESH_PULL_TIMES_OUT") else 3
    rows = time_pulls(
        lambda prompt, max_tokens: generate(mesh, prompt, max_tokens),
        lambda name: mesh.metric("decode", name),
        reference_engine.tokenizer,
        reps,
    )
    write_pull_times("network namespaces (veth pairs, a bridge): UCX over TCP", rows)
    assert all(r["bytes"] > 0 and r["median_ms"] > 0 for r in rows)
    assert rows[-1]["bytes"] > rows[0]["bytes"], "a longer prompt's state is larger"


@pytest.mark.skipif(
    not os.environ.get("DELTAMESH_PULL_TIMES_OUT"), reason="a benchmark's baseline: make bench-multihost"
)
def test_pull_times_on_one_host_for_comparison(tmp_path, reference_engine):
    """The same pulls between workers on one host, over the side channel's default transports (CMA)."""
    metrics_port = free_port()
    local = start_mesh(
        str(DEFAULT_MODEL),
        tmp_path,
        role_args={"decode": ["--metrics-port", str(metrics_port)]},
    )
    try:
        with local.client() as client:
            rows = time_pulls(
                lambda prompt, max_tokens: client.generate(prompt, max_tokens=max_tokens, temperature=0),
                lambda name: metric(f"http://127.0.0.1:{metrics_port}/metrics", name),
                reference_engine.tokenizer,
                reps=7,
            )
    finally:
        local.stop()
    write_pull_times("one host (the default side channel: shared memory / CMA)", rows)


def test_a_prefill_host_cut_off_mid_pull_ends_the_request_cleanly(mesh, reference_engine):
    """The prefill host's link held to a slow rate, so that a long prompt's state takes seconds to cross; the link is
    cut once the decode worker has reserved room and started pulling. The request ends with an error (no hang), the
    decode worker frees its reservation, the prefill worker its lease (by its TTL: no notice can cross a cut link),
    and once the link is back the mesh serves token for token again."""
    prompt = reference_engine.tokenizer.encode("y " * 4000)[:SLOW_PROMPT_TOKENS]
    outcome: dict[str, object] = {}

    def request():
        try:
            outcome["reply"] = generate(mesh, prompt, max_tokens=4)
        except Exception as e:  # the SDK's typed error, whatever it is: recorded and checked below
            outcome["error"], outcome["ended"] = e, time.monotonic()

    mesh.net.limit("prefill", LINK_RATE)
    try:
        thread = threading.Thread(target=request)
        thread.start()
        deadline = time.monotonic() + 60
        while not mesh.metric("decode", "deltamesh_engine_reservations"):
            assert time.monotonic() < deadline and thread.is_alive(), f"no pull started: {outcome}"
            time.sleep(0.05)
        mesh.net.cut("prefill", down=True)
        cut_at = time.monotonic()
        thread.join(TRANSFER_TIMEOUT_S + 60)
        assert not thread.is_alive(), "the request hung after the link went down"
        assert "error" in outcome, f"a request whose state could not cross was answered: {outcome}"
        # the pull's deadline ends it; the margin covers the router's answer on a loaded machine
        waited = outcome["ended"] - cut_at
        assert waited < TRANSFER_TIMEOUT_S + 30, f"the error came {waited:.1f} s after the cut"
        print(
            f"multihost: link cut mid-pull: {type(outcome['error']).__name__} after {waited:.1f} s: {outcome['error']}"
        )
        deadline = time.monotonic() + 30
        while mesh.metric("decode", "deltamesh_engine_reservations") or mesh.metric(
            "decode", "deltamesh_engine_kv_pages_used"
        ):
            assert time.monotonic() < deadline, "the decode worker kept what it reserved for the pull"
            time.sleep(0.2)
    finally:
        mesh.net.cut("prefill", down=False)
        mesh.net.limit("prefill", None)
    deadline = time.monotonic() + LEASE_TTL_S + 30
    while mesh.metric("prefill", "deltamesh_engine_held_states"):
        assert time.monotonic() < deadline, "the prefill worker still holds the state of the failed request"
        time.sleep(0.5)
    mesh.wait_ready()
    ref = reference_engine.generate("The Python language", SamplingParams(max_tokens=20, temperature=0))[0]
    assert generate(mesh, "The Python language", max_tokens=20).token_ids == ref.token_ids

"""The image and docker-compose.yml, really run (marker `docker`: `make test-docker`, which .ci/run runs after
`make test`).

deploy/docker/build-offline.sh builds deltamesh:cpu with no registry (a base image made by debootstrap when
BASE_IMAGE cannot be pulled, pip fed from a local wheelhouse), `docker compose --profile cpu up` (or
docker-compose 1.29 where the v2 plugin is absent) starts the router, a prefill and a decode worker in three
containers, a completion through the published REST port and a generation through the published gRPC port must
be the monolithic engine's greedy output token for token, and `down -v` must leave no container, network or
volume of the project behind. Where no Docker engine runs and this is root with dockerd installed, the test starts
one for itself (and stops it); where Docker cannot start it is skipped, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deltamesh.client import Client
from deltamesh.engine import DEFAULT_MODEL, SamplingParams
from deltamesh.services.common.ports import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.docker,
    # a build of minutes: only where asked for (make test-docker), never inside make test's ten minutes
    pytest.mark.skipif(os.environ.get("DELTAMESH_DOCKER_TEST") != "1", reason="run by make test-docker"),
]
ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 3600  # a cold build on a busy two-core machine with a copying storage driver: about 15 minutes
READY_TIMEOUT_S = 600  # three containers loading the tiny model on two shared cores
PROMPTS = ["The Python language", "A list is"]


def docker(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {result.stderr.strip()[-2000:]}")
    return result


def engine_answers() -> bool:
    try:
        return docker("info", timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory):
    """A Docker engine to talk to: the one running, or one started here (root, dockerd installed)."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH (apt-get install docker.io)")
    if engine_answers():
        yield
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        pytest.skip("no Docker engine answers, and this test can start one only as root with dockerd installed")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    args = ["dockerd"]
    if driver := os.environ.get("DELTAMESH_DOCKER_STORAGE_DRIVER"):
        args.append(f"--storage-driver={driver}")
    with open(log, "w") as out:
        daemon = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not engine_answers():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            pytest.skip(f"dockerd could not start: {log.read_text()[-1500:]}")
        time.sleep(1)
    yield
    daemon.terminate()
    try:
        daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


@pytest.fixture(scope="module")
def compose_command(docker_engine) -> list[str]:
    if docker("compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither the docker compose plugin nor docker-compose is installed (apt-get install docker-compose)")


@pytest.fixture(scope="module")
def image(docker_engine):
    """deltamesh:cpu, built offline from this tree (the build's own layer cache and the wheelhouse make a rebuild
    with unchanged requirements quick)."""
    started = time.monotonic()
    result = subprocess.run(
        ["deploy/docker/build-offline.sh"],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "TAG": "deltamesh:cpu"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, f"the image did not build:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    print(f"docker: image built in {time.monotonic() - started:.0f} s")
    return "deltamesh:cpu"


class Project:
    """One `docker compose` project of docker-compose.yml's cpu profile, its client ports published on free
    loopback ports."""

    def __init__(self, command: list[str]):
        self.name = f"deltamesh-test-{os.getpid()}"
        self.grpc_port, self.http_port = free_port(), free_port()
        self.command = [*command, "-p", self.name, "--profile", "cpu"]
        self.env = {
            **os.environ,
            "DELTAMESH_PUBLISH_GRPC_PORT": str(self.grpc_port),
            "DELTAMESH_PUBLISH_HTTP_PORT": str(self.http_port),
            "DELTAMESH_TORCH_THREADS": "1",
        }

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.command, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def logs(self) -> str:
        out = self.run("logs", "--no-color", "--tail", "40", timeout=60)
        return out.stdout[-6000:] + out.stderr[-1000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            exited = docker(
                "ps",
                "-a",
                "-q",
                "--filter",
                f"label=com.docker.compose.project={self.name}",
                "--filter",
                "status=exited",
            ).stdout.split()
            assert not exited, f"a container exited before the mesh was ready:\n{self.logs()}"
            time.sleep(3)
        raise AssertionError(f"the mesh was not ready within {READY_TIMEOUT_S} s:\n{self.logs()}")

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.name}"
        return {
            "containers": docker("ps", "-a", "-q", "--filter", label).stdout.split(),
            "networks": docker("network", "ls", "-q", "--filter", label).stdout.split(),
            "volumes": docker("volume", "ls", "-q", "--filter", label).stdout.split(),
        }


@pytest.fixture(scope="module")
def project(compose_command, image):
    project = Project(compose_command)
    started = time.monotonic()
    up = project.run("up", "-d", timeout=600)
    try:
        assert up.returncode == 0, f"compose up failed:\n{up.stdout}\n{up.stderr}\n{project.logs()}"
        project.wait_ready()
        print(f"docker: compose up to /ready in {time.monotonic() - started:.0f} s")
        yield project
    finally:
        project.run("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300)


def test_a_request_through_the_published_ports_is_the_monolithic_engines(project, reference_engine):
    """Three containers, gRPC between them over the compose network, the state pulled over UCX between the
    worker containers: the same greedy tokens as the monolithic engine."""
    base = f"http://127.0.0.1:{project.http_port}"
    models = httpx.get(f"{base}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL.name]
    with Client(f"127.0.0.1:{project.grpc_port}") as client:
        for prompt in PROMPTS:
            ref = reference_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
            body = {"model": DEFAULT_MODEL.name, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            choice, usage = reply.json()["choices"][0], reply.json()["usage"]
            assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason.value
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
                len(ref.prompt_token_ids),
                len(ref.token_ids),
            )
            assert client.generate(prompt, max_tokens=16, temperature=0).text == ref.text
    # the request crossed from the prefill container to the decode container: the decode worker pulled a state
    metrics = subprocess.run(
        [
            *project.command,
            "exec",
            "-T",
            "decode",
            "python",
            "-c",
            "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9090/metrics').read().decode())",
        ],
        cwd=ROOT,
        env=project.env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    pulls = [line for line in metrics.splitlines() if line.startswith('deltamesh_transfers_total{outcome="ok"}')]
    assert pulls and float(pulls[0].split()[-1]) >= 2 * len(PROMPTS), f"no state pulls counted:\n{metrics[-2000:]}"


def test_down_leaves_nothing_behind(project):
    started = time.monotonic()
    down = project.run("down", "-v", "--remove-orphans", "--timeout", "20")
    assert down.returncode == 0, down.stderr
    print(f"docker: compose down in {time.monotonic() - started:.0f} s")
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}

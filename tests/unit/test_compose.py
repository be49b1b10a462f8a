"""docker-compose.yml and Dockerfile, checked without Docker, both profiles (tests/e2e/test_docker.py, `make
test-docker`, runs the cpu profile for real; no GPU here for the gpu profile).

The compose file is parsed with PyYAML, `${VAR:-default}` interpolation is resolved with the defaults, and
every service's command (and health check) is parsed by the real `deltamesh` CLI, so a renamed or removed
flag fails here. Then the wiring: bind addresses, advertised names, router address, published ports, health
checks against each service's own gRPC port, profiles (cpu: embedded model on CPU; gpu: NVIDIA device
reservations and the read-only models volume), and the Dockerfile's pins and entrypoint."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from deltamesh.services.cli import app

try:  # typer >= 0.2x vendors its own click; older typer uses click itself
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover
    from click import ClickException, UsageError

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

ROUTER_ROLES = {"router"}
WORKER_ROLES = {"prefill", "decode", "colocated"}
PROFILES = {"cpu", "gpu"}
LOCAL_HOSTS = {"127.0.0.1", "localhost"}

# ---------------------------------------------------------------------------------------------- helpers

_VAR = re.compile(r"\$(?:\$|\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?$", re.S)


def interpolate(value: str) -> str:
    """Compose interpolation with every variable unset: `${V:-d}` / `${V-d}` give d, `$$` gives `$`.
    A variable without a default (or with `:?`) is an error: the file must work with no .env."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(2) is not None:
            raise AssertionError(f"${m.group(2)} has no default")
        b = _BRACED.match(m.group(1))
        if b is None or b.group(2) is None:
            raise AssertionError(f"${{{m.group(1)}}} has no default (use ${{VAR:-default}})")
        return interpolate(b.group(3))

    return _VAR.sub(sub, value)


def resolve(node):
    if isinstance(node, str):
        return interpolate(node)
    if isinstance(node, list):
        return [resolve(x) for x in node]
    if isinstance(node, dict):
        return {k: resolve(v) for k, v in node.items()}
    return node


@pytest.fixture(scope="module")
def compose() -> dict:
    return resolve(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(autouse=True)
def _no_deltamesh_env(monkeypatch):
    """Options also come from DELTAMESH_* variables: parse the commands as the containers would see them."""
    import os

    for key in list(os.environ):
        if key.startswith("DELTAMESH_"):
            monkeypatch.delenv(key)


def cli_params(argv: list) -> dict:
    """Parse argv (without the program name) with the real CLI; return the subcommand's parameters.
    Raises UsageError (NoSuchOption, BadParameter, MissingParameter...) on a bad invocation."""
    assert isinstance(argv, list) and argv, f"command must be a non-empty exec-form list, got {argv!r}"
    assert all(isinstance(a, str) for a in argv), f"every argument must be a string (quote numbers): {argv!r}"
    group = typer.main.get_command(app)
    sub = group.commands.get(argv[0])
    if sub is None:
        raise UsageError(f"no such deltamesh command {argv[0]!r}; commands: {sorted(group.commands)}")
    ctx = sub.make_context(argv[0], list(argv[1:]))
    return dict(ctx.params)


def services(compose: dict) -> dict:
    return {name: svc for name, svc in compose["services"].items()}


def profile_of(name: str, svc: dict) -> str:
    profiles = svc.get("profiles") or []
    assert len(profiles) == 1 and profiles[0] in PROFILES, f"{name}: exactly one profile of {PROFILES}, got {profiles}"
    return profiles[0]


def role_of(svc: dict) -> str:
    return svc["command"][0]


def grpc_port(svc: dict) -> int:
    params = cli_params(svc["command"])
    return params["grpc_port"] if role_of(svc) in ROUTER_ROLES else params["port"]


def routers_by_profile(compose: dict) -> dict[str, tuple[str, dict]]:
    out = {}
    for name, svc in services(compose).items():
        if role_of(svc) in ROUTER_ROLES:
            p = profile_of(name, svc)
            assert p not in out, f"profile {p} has two routers: {out[p][0]} and {name}"
            out[p] = (name, svc)
    return out


def parse_ports(entries: list) -> list[tuple[str, int, int]]:
    """(host_ip, published, target) for short ("IP:HOST:CONTAINER[/proto]") and long syntax."""
    out = []
    for e in entries:
        if isinstance(e, dict):
            out.append((e.get("host_ip", ""), int(e.get("published", 0) or 0), int(e["target"])))
            continue
        spec = str(e).split("/")[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 3:
            ip, pub, tgt = parts
        elif len(parts) == 2:
            ip, (pub, tgt) = "", parts
        else:
            ip, pub, tgt = "", "", parts[0]
        out.append((ip.strip("[]"), int(pub) if pub else 0, int(tgt)))
    return out


def volume_mounts(svc: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) for short and long volume syntax."""
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, dict):
            out.append((v.get("source", ""), v["target"], bool(v.get("read_only", False))))
        else:
            parts = v.split(":")
            mode = parts[2].split(",") if len(parts) > 2 else []
            out.append((parts[0], parts[1], "ro" in mode))
    return out


# ---------------------------------------------------------------------------------------------- compose


def test_interpolation_resolver():
    assert interpolate("a${X:-b}c") == "abc"
    assert interpolate("${X-}") == ""
    assert interpolate("$${X}") == "${X}"
    assert interpolate("/models/${N:-tiny}/x") == "/models/tiny/x"
    with pytest.raises(AssertionError):
        interpolate("${X}")
    with pytest.raises(AssertionError):
        interpolate("${X:?required}")


def test_cli_parser_rejects_bad_invocations():
    """The checks below rely on make_context validating without running anything."""
    assert cli_params(["router", "--grpc-port", "1"])["grpc_port"] == 1
    with pytest.raises(UsageError):
        cli_params(["router", "--no-such-flag"])
    with pytest.raises(UsageError):
        cli_params(["prefill", "--port", "not-a-number"])
    with pytest.raises(UsageError):
        cli_params(["no-such-command"])


def test_services_and_profiles(compose):
    svcs = services(compose)
    assert svcs, "no services"
    by_profile: dict[str, set[str]] = {p: set() for p in PROFILES}
    for name, svc in svcs.items():
        by_profile[profile_of(name, svc)].add(role_of(svc))
    for p in PROFILES:
        assert {"router", "prefill", "decode"} <= by_profile[p], f"profile {p} lacks a role: {by_profile[p]}"
    assert {"router", "prefill", "decode"} <= set(svcs), "the cpu services keep the plain names"


def test_every_service_runs_the_image_built_from_the_dockerfile(compose):
    declared_args = {m.group(1) for m in re.finditer(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)", DOCKERFILE.read_text(), re.M)}
    builds: dict[str, tuple] = {}
    for name, svc in services(compose).items():
        build = svc.get("build")
        assert isinstance(build, dict), f"{name}: needs a build section (context + Dockerfile)"
        assert (COMPOSE.parent / build.get("context", ".")).resolve() == ROOT, f"{name}: build context is not the repo"
        assert build.get("dockerfile", "Dockerfile") == "Dockerfile", f"{name}: builds another Dockerfile"
        args = build.get("args") or {}
        assert set(args) <= declared_args, (
            f"{name}: build args {set(args) - declared_args} are not ARGs of the Dockerfile"
        )
        image = svc.get("image", "")
        assert image.startswith("deltamesh:"), f"{name}: image {image!r} is not a deltamesh image"
        assert "entrypoint" not in svc, f"{name}: overrides the image's deltamesh entrypoint"
        # services naming one image must build it the same way (Compose builds it once)
        key = json.dumps(build, sort_keys=True)
        assert builds.setdefault(image, key) == key, f"{name}: builds {image} differently from another service"
        p = profile_of(name, svc)
        if p == "gpu":
            assert args.get("EXTRAS") == "gpu", f"{name}: the gpu image needs EXTRAS=gpu"
            assert re.search(r"/whl/cu\d+", args.get("TORCH_INDEX", "")), (
                f"{name}: the gpu image needs a CUDA torch index"
            )
        else:
            assert not args.get("EXTRAS") and "cu" not in args.get("TORCH_INDEX", "/whl/cpu").rsplit("/", 1)[-1], (
                f"{name}: the cpu image must keep the CPU torch build"
            )


def test_every_command_parses(compose):
    for name, svc in services(compose).items():
        try:
            cli_params(svc["command"])
        except ClickException as e:
            pytest.fail(f"{name}: `deltamesh {shlex.join(svc['command'])}`: {e.format_message()}")


def test_services_bind_all_interfaces_on_a_user_defined_network(compose):
    networks = compose.get("networks") or {}
    for name, svc in services(compose).items():
        params = cli_params(svc["command"])
        assert params["host"] == "0.0.0.0", f"{name}: must bind 0.0.0.0 to be reachable from other containers"
        assert "network_mode" not in svc, f"{name}: network_mode would leave the compose network"
        nets = svc.get("networks")
        assert nets, f"{name}: not on a user-defined network"
        for net in nets:
            assert net in networks and net != "default", f"{name}: network {net!r} is not declared at top level"


def test_workers_register_with_their_router_under_a_reachable_name(compose):
    routers = routers_by_profile(compose)
    for name, svc in services(compose).items():
        if role_of(svc) not in WORKER_ROLES:
            continue
        params = cli_params(svc["command"])
        router_name, router_svc = routers[profile_of(name, svc)]
        assert params["router"] == f"{router_name}:{cli_params(router_svc['command'])['control_port']}", (
            f"{name}: --router {params['router']!r} is not its profile's router service's control plane"
        )
        # The router dials the address a worker registers; with a 0.0.0.0 bind that must be a DNS name
        # of the container on the compose network (the service name, its hostname or an alias).
        names = {name, svc.get("hostname")} | {
            a
            for cfg in (svc["networks"].values() if isinstance(svc["networks"], dict) else [])
            if cfg
            for a in cfg.get("aliases", [])
        }
        names.discard(None)
        assert params.get("advertise_host") in names, (
            f"{name}: --advertise-host {params.get('advertise_host')!r} is not a name the router can resolve ({names})"
        )
        assert params["port"] > 0, f"{name}: a fixed --port is needed (health check, registration)"
        assert params["metrics_port"] and params["metrics_port"] != params["port"], f"{name}: --metrics-port"
        # UCX shared memory cannot cross containers; peer error handling (the default) keeps UCX off it.
        assert params["ucx_error_handling"], f"{name}: --no-ucx-error-handling would let UCX try shared memory"
        assert "ports" not in svc, f"{name}: workers are reached on the compose network only"
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict) and deps.get(router_name, {}).get("condition") == "service_healthy", (
            f"{name}: should wait for {router_name} to be healthy"
        )


def test_router_and_workers_share_the_mesh_secret_through_a_volume(compose):
    """The router makes the secret file on first start (rw mount); its workers read it (ro mount); nothing else."""
    routers = routers_by_profile(compose)
    for name, svc in services(compose).items():
        path = cli_params(svc["command"])["mesh_secret_file"]
        router_name, router_svc = routers[profile_of(name, svc)]
        assert path and path == cli_params(router_svc["command"])["mesh_secret_file"], (
            f"{name}: not its router's secret"
        )
        mounts = [v.split(":") for v in svc.get("volumes", []) if v.split(":")[1] == str(Path(path).parent)]
        assert len(mounts) == 1, f"{name}: the secret's folder {Path(path).parent} is not mounted"
        volume, mode = mounts[0][0], (mounts[0] + ["rw"])[2]
        router_volume = next(
            v.split(":")[0] for v in router_svc["volumes"] if v.split(":")[1] == str(Path(path).parent)
        )
        assert volume == router_volume and volume in compose["volumes"], f"{name}: another volume than its router's"
        assert (mode == "rw") == (name == router_name), f"{name}: only the router writes the secret"
    assert "chown deltamesh:deltamesh /run/deltamesh" in DOCKERFILE.read_text(), "the service user must own the mount"


def test_only_the_router_publishes_ports_and_only_on_loopback(compose):
    for name, svc in services(compose).items():
        if role_of(svc) not in ROUTER_ROLES:
            assert not svc.get("ports"), f"{name}: publishes ports"
            continue
        params = cli_params(svc["command"])
        published = parse_ports(svc.get("ports") or [])
        for ip, pub, tgt in published:
            assert ip == "127.0.0.1", f"{name}: port {tgt} published on {ip or 'every interface'}, not 127.0.0.1"
            assert pub == tgt, f"{name}: host port {pub} != container port {tgt}"
        assert {tgt for *_, tgt in published} == {params["grpc_port"], params["http_port"]}, (
            f"{name}: published {published} do not match --grpc-port {params['grpc_port']} / --http-port {params['http_port']}"
        )


def test_healthchecks_ask_each_services_own_grpc_port(compose):
    for name, svc in services(compose).items():
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable"), f"{name}: no health check"
        test = hc["test"]
        assert isinstance(test, list) and test[0] == "CMD", f"{name}: health check must be an exec-form CMD list"
        assert test[1] == "deltamesh", f"{name}: health check must run deltamesh, got {test}"
        args = cli_params(test[2:])
        assert test[2] == "health", f"{name}: health check runs `deltamesh {test[2]}`"
        host, _, port = args["address"].rpartition(":")
        assert host in LOCAL_HOSTS, f"{name}: health check should ask the container itself, not {host}"
        assert int(port) == grpc_port(svc), (
            f"{name}: health check port {port} != the service's gRPC port {grpc_port(svc)}"
        )
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in hc, f"{name}: healthcheck.{key} missing"


def test_cpu_profile_runs_the_embedded_model_on_cpu(compose):
    for name, svc in services(compose).items():
        if profile_of(name, svc) != "cpu":
            continue
        params = cli_params(svc["command"])
        if role_of(svc) in WORKER_ROLES:
            assert params["device"] == "cpu", f"{name}: --device {params['device']}"
        assert "--model" not in svc["command"], f"{name}: the cpu profile uses the model embedded in the image"
        assert "deploy" not in svc, f"{name}: the cpu profile reserves no devices"
        assert all(v.startswith("mesh-secret:") for v in svc.get("volumes", [])), (
            f"{name}: the cpu profile needs no model volume"
        )


def test_gpu_profile_reserves_nvidia_devices_and_mounts_the_model_volume(compose):
    assert "models" in (compose.get("volumes") or {}), "no top-level models volume"
    models = set()
    for name, svc in services(compose).items():
        if profile_of(name, svc) != "gpu":
            continue
        params = cli_params(svc["command"])
        assert params["model"].startswith("/models/"), f"{name}: --model {params['model']!r} not under /models"
        models.add(params["model"])
        assert ("models", "/models", True) in volume_mounts(svc), (
            f"{name}: models volume not mounted read-only at /models"
        )
        if role_of(svc) in WORKER_ROLES:
            assert params["device"].startswith("cuda"), f"{name}: --device {params['device']}"
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            nvidia = [d for d in devices if d.get("driver") == "nvidia"]
            assert nvidia, f"{name}: no nvidia device reservation"
            for d in nvidia:
                assert "gpu" in d.get("capabilities", []), f"{name}: reservation lacks the gpu capability"
                assert ("count" in d) != ("device_ids" in d), f"{name}: give count or device_ids (not both)"
                assert all(isinstance(i, str) for i in d.get("device_ids", [])), f"{name}: device_ids are strings"
    assert len(models) == 1, f"router and workers must serve the same checkpoint, got {models}"


def test_every_dependency_is_in_the_same_profile(compose):
    svcs = services(compose)
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        for dep in deps:
            assert dep in svcs, f"{name}: depends on unknown service {dep}"
            assert profile_of(dep, svcs[dep]) == profile_of(name, svc), f"{name}: depends on {dep} of another profile"
            assert svcs[dep].get("healthcheck"), f"{name}: waits for {dep}, which has no health check"


# ---------------------------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        if buf:
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_args() -> dict[str, str]:
    args = {}
    for ins, rest in dockerfile_instructions():
        if ins == "ARG":
            k, _, v = rest.partition("=")
            args[k] = v.strip('"')
    return args


def makefile_torch_pin() -> str:
    m = re.search(r"^TORCH_PIN\s*:?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert m, "Makefile has no TORCH_PIN"
    return m.group(1)


def test_dockerfile_entrypoint_is_deltamesh():
    entry = [rest for ins, rest in dockerfile_instructions() if ins == "ENTRYPOINT"]
    assert entry, "no ENTRYPOINT"
    assert json.loads(entry[-1]) == ["deltamesh"], f"ENTRYPOINT {entry[-1]}"


def test_dockerfile_base_and_build_args():
    args = dockerfile_args()
    froms = [rest for ins, rest in dockerfile_instructions() if ins == "FROM"]
    assert froms == ["${BASE_IMAGE}"], f"FROM {froms}: one stage, base chosen by the BASE_IMAGE build arg"
    assert args.get("BASE_IMAGE") == "python:3.11-slim"
    assert args.get("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu", "the default image is CPU-only"
    assert "EXTRAS" in args


def test_dockerfile_installs_pinned_torch_generates_stubs_and_installs_sdk():
    runs = " ; ".join(rest for ins, rest in dockerfile_instructions() if ins == "RUN")
    assert dockerfile_args().get("TORCH_VERSION") == makefile_torch_pin(), (
        "torch pin differs from the Makefile's TORCH_PIN"
    )
    assert re.search(r'pip install "?torch==\$\{TORCH_VERSION\}"? --index-url "?\$\{TORCH_INDEX\}"?', runs), (
        "torch is not installed pinned from TORCH_INDEX"
    )
    assert "make protos" in runs, "the gRPC stubs are not generated"
    assert re.search(r"pip install .*-e sdk\b", runs), "the SDK is not installed"
    assert re.search(r'pip install .*-e "?\.', runs), "the package is not installed"


def test_dockerfile_runs_as_a_non_root_user():
    users = [rest for ins, rest in dockerfile_instructions() if ins == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, f"USER {users}"
    last_user = max(i for i, (ins, _) in enumerate(dockerfile_instructions()) if ins == "USER")
    runs_after = [i for i, (ins, _) in enumerate(dockerfile_instructions()) if ins == "RUN" and i > last_user]
    assert not runs_after, "RUN after the final USER (installs would happen as the service user)"


def test_dockerignore_keeps_local_environments_out_and_the_sources_in():
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.strip().startswith("#")]
    for needed in (".venv", ".gpu-wheels", ".git"):
        assert needed in patterns, f".dockerignore does not exclude {needed}"

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = False
        for p in patterns:
            neg = p.startswith("!")
            pat = p[1:] if neg else p
            pat = pat.strip("/")
            if any(fnmatch.fnmatch(pre, pat) or fnmatch.fnmatch(pre, pat.replace("**/", "")) for pre in prefixes):
                hit = not neg
        return hit

    assert ignored(".venv/bin/python") and ignored("deltamesh/engine/__pycache__/x.pyc")
    for path in (
        "Makefile",
        "pyproject.toml",
        "protos/deltamesh/v1/router.proto",
        "sdk/pyproject.toml",
        "sdk/src/deltamesh/client/__init__.py",
        "deltamesh/engine/__init__.py",
        "deltamesh/services/cli.py",
        "models/deltamesh-tiny/config.json",
        "README.md",
    ):
        assert not ignored(path), f".dockerignore excludes {path}, which the image needs"

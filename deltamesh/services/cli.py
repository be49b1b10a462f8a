"""The `deltamesh` command: serve the whole mesh, run one service, or generate through a router.

Every option can also come from a DELTAMESH_* environment variable (shown in --help)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections import Counter
from typing import Annotated, Optional

import typer
from pydantic import ValidationError

from deltamesh.client.cli import generate
from deltamesh.planner.commands import plan, profile
from deltamesh.services.common.logs import write_line
from deltamesh.services.common.options import (
    Option,
    hand_over,
    handed_settings,
    options,
    settings_from,
    settings_problem,
    started_by_serve,
    with_options,
)
from deltamesh.services.common.ports import ListenProblem, check_listeners, free_port
from deltamesh.services.common.settings import RouterSettings, ServeSettings, WorkerSettings
from deltamesh.services.common.tls import TlsSettings
from deltamesh.services.common.vllm_flags import MODEL_ARGUMENT_HELP, VllmFlags, one_flag_per_value, served_model
from deltamesh.services.ready_notice import announce_when_ready
from deltamesh.services.supervisor import CONFIG_ERROR, ChildSpec, Supervisor, die_with_parent, exit_without_teardown
from deltamesh.services.token_map_command import token_map

# plain help (rich_markup_mode=None): rich tables cut long option names at 80 columns; plain help wraps them
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)
for _name, _command in (("generate", generate), ("profile", profile), ("plan", plan), ("token-map", token_map)):
    app.command(_name)(_command)

# the mesh secret is read from this file (or $DELTAMESH_MESH_SECRET) into the settings' mesh_secret
SECRET_FILE = Option(
    "mesh_secret_file",
    (),
    Optional[str],  # noqa: UP045  (a value handed to typer, which reads Optional)
    None,
    "File holding the mesh secret shared by the "
    "router and its workers (default: $DELTAMESH_MESH_SECRET); the router makes it if it is "
    "missing",
)
# the API key from a file (or $DELTAMESH_API_KEY) rather than --api-key, which any user of the machine reads in `ps`
API_KEY_FILE = Option(
    "api_key_file",
    (),
    Optional[str],  # noqa: UP045
    None,
    "File holding the API key (--api-key on a command line is visible to every user of the machine; or set "
    "DELTAMESH_API_KEY)",
)
TLS = options(TlsSettings, prefix="tls_")
WORKER = options(WorkerSettings) + [SECRET_FILE]
ROUTER = options(RouterSettings) + [SECRET_FILE, API_KEY_FILE]
# serve starts workers on ports of its own choosing, registered with its router, and their threads shared out
PER_WORKER = ("port", "router", "advertise_host", "metrics_port", "torch_threads")
ROUTER_ONLY = (
    "prefill",
    "decode",
    "colocated",
    "max_prompts",
    "max_choices",
    "max_messages",
    "max_running_choices",
    "max_prefilling_tokens",
    "http_header_timeout",
    "http_body_timeout",
    "ready_timeout",
)
SERVE_ROUTER = options(RouterSettings, exclude=ROUTER_ONLY)
SERVE_WORKER = options(WorkerSettings, exclude=PER_WORKER)
VLLM_FLAGS = options(VllmFlags)


def _check_tls(tls: TlsSettings) -> None:
    try:
        tls.check()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _refuse(command: str, message: str, code: int = 2) -> None:
    """One line saying what to change, and exit `code` (2: a usage error), before anything starts."""
    write_line(sys.stderr, f"deltamesh {command}: {message}")
    raise typer.Exit(code)


def _settings(command: str, model, opts: list[Option], values: dict, handed: dict | None = None, **fixed):
    """settings_from, a value out of its range refused in one line naming its flag."""
    try:
        return settings_from(model, opts, values, handed, **fixed)
    except ValidationError as e:
        _refuse(command, settings_problem(e, opts))


def _can_listen(command: str, host: str, ports: dict[str, int | None]) -> None:
    """Exit at once, in one line naming the flag, when the host or a port cannot be listened on: before the
    model loads, not after it with the server's tracebacks."""
    try:
        check_listeners(host, ports)
    except ListenProblem as e:
        _refuse(command, str(e))


def _transport_known(name: str, interface: str | None) -> None:
    from deltamesh.transfer import TRANSPORTS

    if name not in TRANSPORTS:
        raise typer.BadParameter(
            f"unknown transport {name!r}; transports: {', '.join(TRANSPORTS)}", param_hint="--transport"
        )
    if interface is not None and interface not in {n for _, n in socket.if_nameindex()}:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise typer.BadParameter(f"no interface {interface!r} here ({names})", param_hint="--side-channel-interface")


def _servable(command: str, model: str, engine=None, code: int = CONFIG_ERROR, budget: bool = True) -> None:
    """A model directory (and engine settings, device included, and a memory budget that holds the model and a
    request unless `budget` is False) this machine can serve, or one line saying why and exit `code`: at once, not
    after imports and a model load, and not once per restart."""
    from deltamesh.engine.config import ModelConfig

    try:
        ModelConfig.from_dir(model)
        if engine is not None:
            engine.validate()
            if budget:
                # imported here: it imports torch, which the router (engine None) must not load
                from deltamesh.engine.memory_budget import check_before_start

                check_before_start(engine)
    except (ValueError, OSError) as e:
        print(f"deltamesh {command}: {e}", file=sys.stderr)
        raise typer.Exit(code) from None


def _mesh_secret(secret_file: str | None, create: bool = False):
    from deltamesh.services.common.auth import MissingSecret, load_mesh_secret

    try:
        return load_mesh_secret(secret_file, create)
    except MissingSecret as e:
        raise typer.BadParameter(str(e), param_hint="--mesh-secret-file / DELTAMESH_MESH_SECRET") from None


def _api_key(ctx: typer.Context, values: dict) -> str | None:
    """The API key from --api-key-file, --api-key or DELTAMESH_API_KEY; a warning when it is on the command line."""
    from deltamesh.services.common.auth import MissingSecret, read_secret_file

    key, key_file = values.get("api_key"), values.get("api_key_file")
    if key_file:
        if key:
            raise typer.BadParameter("give the API key once: in a file or as the key", param_hint="--api-key-file")
        try:
            key = read_secret_file(key_file, "API key")
        except MissingSecret as e:
            raise typer.BadParameter(str(e), param_hint="--api-key-file") from None
        if not key:
            raise typer.BadParameter(f"the API key file {key_file} is empty", param_hint="--api-key-file")
    elif key and (source := ctx.get_parameter_source("api_key")) is not None and source.name == "COMMANDLINE":
        write_line(
            sys.stderr,
            "deltamesh: warning: --api-key on the command line can be read by every user of this machine "
            "(ps, /proc); give it with --api-key-file or DELTAMESH_API_KEY",
        )
    return key


def _start(name: str, settings, serve) -> None:
    import structlog

    from deltamesh.services.common.logs import configure_logging
    from deltamesh.services.common.server import run
    from deltamesh.services.common.settings import print_settings

    if started_by_serve():
        die_with_parent(os.getppid())
    configure_logging(name, settings.log_level)
    if getattr(settings, "process_index", None) is not None:  # one of several router processes: which, in every line
        structlog.contextvars.bind_contextvars(process=settings.process_index)
    if settings.log_level == "debug":  # a page of JSON per process: what a start-up problem needs, not every start
        print_settings(name, settings)
    run(lambda stop: serve(settings, stop))


def _worker_command(role: str):
    @with_options(WORKER)
    def command(**values) -> None:
        settings = _settings(
            role,
            WorkerSettings,
            WORKER,
            values,
            handed_settings(),
            role=role,
            mesh_secret=_mesh_secret(values["mesh_secret_file"]),
        )
        _can_listen(role, settings.host, {"--port": settings.port, "--metrics-port": settings.metrics_port})
        _transport_known(settings.transport, settings.side_channel_interface)
        _check_tls(settings.tls)
        _servable(role, settings.engine.model, settings.engine)
        if role == "prefill":
            from deltamesh.services.prefill.main import serve
        else:
            from deltamesh.services.decode.main import serve
        _start(role, settings, serve)

    command.__doc__ = {
        "prefill": "Run a prefill worker: prefill prompts, hold their state under leases for decode workers.",
        "decode": "Run a decode worker: pull request state from prefill workers and decode in a continuous batch.",
        "colocated": "Run a colocated worker: prefill and decode its own requests (the aggregated baseline).",
    }[role]
    return command


for _role in ("prefill", "decode", "colocated"):
    app.command(_role)(_worker_command(_role))


@app.command()
@with_options(ROUTER)
def router(ctx: typer.Context, **values) -> None:
    """Run the router: gRPC client API, OpenAI-compatible REST gateway, and the workers' control plane."""
    settings = _settings(
        "router",
        RouterSettings,
        ROUTER,
        {**values, "api_key": _api_key(ctx, values)},
        handed_settings(),
        mesh_secret=_mesh_secret(values["mesh_secret_file"], create=True),
    )
    from deltamesh.services.router.processes import own_control_port, router_ports

    # one of several router processes checks only its own control port: its siblings share the client ports
    one_of_several = settings.process_index is not None
    _can_listen(
        "router",
        settings.host,
        {"--control-port": own_control_port(settings)} if one_of_several else router_ports(settings),
    )
    _check_tls(settings.tls)
    _servable("router", settings.model)
    if settings.api_server_count > 1 and not one_of_several:
        from deltamesh.services.router.processes import run_router_processes

        env = _child_env(settings.mesh_secret.get_secret_value(), settings.api_key)
        raise typer.Exit(run_router_processes(settings, env))
    from deltamesh.services.router.main import serve

    _start("router", settings, serve)


@app.command()
@with_options(TLS)
def health(
    address: Annotated[str, typer.Argument(help="host:port of a deltamesh service")],
    service: Annotated[str, typer.Option(help="Service name to check ('' = the whole server)")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds")] = 3.0,
    **values,
) -> None:
    """Exit 0 if the service answers the standard gRPC health check as SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from deltamesh.services.common.tls import channel_credentials

    tls = settings_from(TlsSettings, TLS, values)
    _check_tls(tls)
    try:
        channel = (
            grpc.secure_channel(address, channel_credentials(tls)) if tls.enabled else grpc.insecure_channel(address)
        )
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        raise typer.Exit(1) from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise typer.Exit(1)


@app.command()
@with_options([SECRET_FILE])
def loads(
    control: Annotated[str, typer.Argument(help="The router's control plane (its --control-port)")] = "127.0.0.1:50052",
    **values,
) -> None:
    """Print every worker's load as the router sees it (JSON lines); needs the mesh secret."""
    import grpc

    from deltamesh.services.router.control import read_loads

    try:
        workers = read_loads(control, _mesh_secret(values["mesh_secret_file"]))
    except grpc.RpcError as e:
        print(f"{control}: {e.code().name}: {e.details()}", file=sys.stderr)
        raise typer.Exit(1) from None
    for load in workers:
        print(load_line(load))


def load_line(load) -> str:
    """A WorkerLoad as one JSON object: its fields by their proto names, counters as numbers (protobuf's JSON
    mapping writes 64-bit ones as strings, "0"). WorkerLoad is flat, so its fields' values are JSON's own."""
    import json

    return json.dumps({f.name: getattr(load, f.name) for f in load.DESCRIPTOR.fields})


@app.command()
@with_options(options(ServeSettings), SERVE_WORKER, SERVE_ROUTER, VLLM_FLAGS, [SECRET_FILE, API_KEY_FILE])
def serve(
    ctx: typer.Context,
    model_argument: Annotated[str | None, typer.Argument(metavar="MODEL", help=MODEL_ARGUMENT_HELP)] = None,
    **values,
) -> None:
    """Start the mesh on one box: router + N prefill + M decode worker processes, each restarted if it exits.
    Ctrl-C stops them all."""
    from deltamesh.services.router.processes import control_ports

    values["model"] = served_model(ctx, model_argument, values["model"])
    _settings("serve", VllmFlags, VLLM_FLAGS, values)  # a vLLM flag's value deltamesh cannot honour, refused
    values["api_key"] = _api_key(ctx, values)  # its router gets it in its environment
    # one secret per mesh, made here unless given (a --mesh-secret-file that does not exist yet is made, as the
    # router makes it); children get it in their environment (never on a command line)
    has_secret = values["mesh_secret_file"] or os.environ.get("DELTAMESH_MESH_SECRET")
    secret = _mesh_secret(values["mesh_secret_file"], create=True) if has_secret else secrets.token_urlsafe(32)
    router, mesh = _plan(values, secret)
    _can_listen("serve", router.host, _serve_ports(router, mesh))
    worker = _settings("serve", WorkerSettings, WORKER, values, role=mesh.roles[0], mesh_secret=secret)
    _transport_known(worker.transport, worker.side_channel_interface)
    engine = worker.engine
    _servable("serve", engine.model, engine, code=2, budget=False)  # the same model and kind of device for all
    _budgets_fit(_planned(values, secret, mesh.roles, mesh.gpus))  # each worker's own, before anything starts
    specs, metrics_urls = _children(values, secret, router, mesh)
    host = router.host
    where = f"gRPC {host}:{router.grpc_port}" + (
        f", REST http://{host}:{router.http_port}/v1" if router.http_port else ""
    )
    write_line(sys.stderr, f"deltamesh: router {where}; metrics: {', '.join(metrics_urls)}")
    announce_when_ready([f"{host}:{p}" for p in control_ports(router)], secret, Counter(mesh.roles), router.tls, where)
    exit_without_teardown(Supervisor(specs).run())  # every child reaped


def _plan(values: dict, secret: str) -> tuple[RouterSettings, ServeSettings]:
    """What `serve` starts: its router's settings, and which workers (ServeSettings.roles)."""
    mesh = _settings("serve", ServeSettings, options(ServeSettings), values)
    router = _settings("serve", RouterSettings, SERVE_ROUTER, values, mesh_secret=secret)
    _check_tls(router.tls)
    return router, mesh


def _serve_ports(router: RouterSettings, mesh: ServeSettings) -> dict[str, int | None]:
    """Every port `serve` binds that is known before its children start, by the flag that sets it."""
    from deltamesh.services.router.processes import router_ports

    ports = router_ports(router)
    for i, name in enumerate(_worker_names(mesh.roles)):
        if fixed := mesh.worker_ports(i):
            grpc_port, metrics_port = fixed
            ports[f"{name}'s gRPC port from --worker-port-base"] = grpc_port
            ports[f"{name}'s metrics port from --worker-port-base"] = metrics_port
    return ports


def _worker_names(roles: list[str]) -> list[str]:
    """What serve's logs call its workers: prefill-0, prefill-1, decode-0, ..."""
    return [f"{role}-{roles[:i].count(role)}" for i, role in enumerate(roles)]


def _children(
    values: dict, secret: str, router: RouterSettings, mesh: ServeSettings
) -> tuple[list[ChildSpec], list[str]]:
    """The processes `serve` starts (its router, then a worker per role), each handed its settings in its
    environment, and the workers' metrics URLs."""
    from deltamesh.services.router.processes import control_ports, router_specs

    base_env = _child_env(secret)
    router_env = _child_env(secret, router.api_key)
    cli = [sys.executable, "-m", "deltamesh.services.cli"]
    if router.api_server_count > 1:
        specs = router_specs(router, router_env)
    else:
        specs = [ChildSpec("router", cli + ["router"], {**router_env, **hand_over(router)})]
    # every worker registers with every process of the router (a registration reply would name them too)
    routers = ",".join(f"{router.host}:{port}" for port in control_ports(router))
    gpu_ids = (mesh.gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "0")).split(",")
    host, metrics_urls, roles = router.host, [], mesh.roles
    taken = frozenset(p for p in _serve_ports(router, mesh).values() if p)
    for i, (role, name) in enumerate(zip(roles, _worker_names(roles))):
        # fixed ports, chosen once: a restarted worker comes back at the address the router knows it by
        port, metrics_port = mesh.worker_ports(i) or (free_port(host, taken), free_port(host, taken))
        taken |= {port, metrics_port}
        own = {
            "port": port,
            "router": routers,
            "metrics_port": metrics_port,
            "torch_threads": max(1, (os.cpu_count() or 1) // len(roles)) if values["device"] == "cpu" else None,
        }
        worker = settings_from(
            WorkerSettings, WORKER, {**_role_values(values, role), **own}, role=role, mesh_secret=secret
        )
        env = {**base_env, **hand_over(worker)}
        if worker.engine.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = _worker_gpus(gpu_ids, i, worker.engine.num_ranks)
        metrics_urls.append(f"{role} http://{host}:{worker.metrics_port}/metrics")
        specs.append(ChildSpec(name, cli + [role], env))
    return specs, metrics_urls


def _child_env(secret: str, api_key: str | None = None) -> dict[str, str]:
    """The environment of a process this one starts: the mesh secret (and the router's API key) travel here, never
    on a command line."""
    env = {k: v for k, v in os.environ.items() if k not in ("DELTAMESH_MESH_SECRET_FILE", "DELTAMESH_API_KEY_FILE")}
    env["DELTAMESH_MESH_SECRET"] = secret
    if api_key:
        env["DELTAMESH_API_KEY"] = api_key
    return env


# serve's per-role memory budgets (--prefill-gpu-memory-utilization, ...) over the flags every worker takes
ROLE_BUDGETS = ("gpu_memory_utilization", "kv_cache_memory_gb")


def _role_values(values: dict, role: str) -> dict:
    """serve's option values for a worker of `role`: its role's own budget where one was given."""
    own = {name: values.get(f"{role}_{name}") for name in ROLE_BUDGETS}
    return {**values, **{name: value for name, value in own.items() if value is not None}}


def _planned(values: dict, secret: str, roles: list[str], gpus: str | None):
    """Each worker `serve` would start: its name, engine settings and GPUs."""
    from deltamesh.services.gpu_shares import PlannedWorker

    gpu_ids = (gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "0")).split(",")
    planned = []
    for i, role in enumerate(roles):
        engine = settings_from(WorkerSettings, WORKER, _role_values(values, role), role=role, mesh_secret=secret).engine
        on = _worker_gpus(gpu_ids, i, engine.num_ranks).split(",") if engine.device.startswith("cuda") else []
        planned.append(PlannedWorker(f"{role}-{roles[:i].count(role)}", engine, tuple(on)))
    return planned


def _budgets_fit(workers) -> None:
    """Every worker's settings valid and its memory budget enough (gpu_shares.py), or one line and exit 2."""
    from deltamesh.services.gpu_shares import check_workers

    try:
        for w in workers:
            try:
                w.engine.validate()
            except ValueError as e:
                raise ValueError(f"{w.name}: {e}") from None
        check_workers(workers)
    except ValueError as e:
        print(f"deltamesh serve: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


def _worker_gpus(gpu_ids: list[str], worker: int, ranks: int) -> str:
    """The GPUs of the `worker`-th worker: `ranks` consecutive ids of the list, workers taking turns around it
    (with fewer GPUs than workers, workers share them; a worker's own ranks never do)."""
    if ranks > len(gpu_ids):
        raise typer.BadParameter(
            f"a worker of {ranks} ranks (--tensor-parallel-size x --data-parallel-size) needs "
            f"{ranks} GPUs; only "
            f"{','.join(gpu_ids)} given",
            param_hint="--gpus / CUDA_VISIBLE_DEVICES",
        )
    return ",".join(gpu_ids[(worker * ranks + r) % len(gpu_ids)] for r in range(ranks))


def main() -> None:
    sys.argv = one_flag_per_value(sys.argv, "--served-model-name")
    app()


if __name__ == "__main__":
    main()

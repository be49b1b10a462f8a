"""The `deltamesh` command: serve the whole mesh, run one service, or generate through a router.

Every option can also come from a DELTAMESH_* environment variable (shown in --help)."""

from __future__ import annotations

import os
import random
import secrets
import socket
import sys
from typing import Annotated, Optional

import typer

from deltamesh.client.cli import generate
from deltamesh.engine.defaults import DEFAULT_MODEL  # torch-free: the engine is imported by the commands that run one
from deltamesh.services.supervisor import ChildSpec, Supervisor

# plain help (rich_markup_mode=None): rich tables cut long option names at 80 columns; plain help wraps them
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)
app.command("generate")(generate)


def _opt(help: str, env: str, *names: str):
    return typer.Option(*names, help=help, envvar=f"DELTAMESH_{env}")


ControlPort = Annotated[int, _opt("Router gRPC port of the control plane (workers register here; mesh secret "
                                  "required)", "CONTROL_PORT")]  # fmt: skip
Model = Annotated[str, _opt("Hugging Face checkpoint directory (default: the embedded model)", "MODEL")]
Device = Annotated[str, _opt("cpu | cuda | cuda:N", "DEVICE")]
Host = Annotated[str, _opt("Address to bind (loopback unless told otherwise)", "HOST")]
Dtype = Annotated[str, _opt("auto | float32 | bfloat16", "DTYPE")]
StateDtype = Annotated[str, _opt("GDN recurrent state dtype: float32 | bfloat16", "STATE_DTYPE")]
PageSize = Annotated[int, _opt("KV page size in tokens", "PAGE_SIZE")]
NumPages = Annotated[Optional[int], _opt("KV pages per worker (default: sized from memory)", "NUM_KV_PAGES")]
MaxSeqs = Annotated[int, _opt("Concurrent requests per worker (= GDN state slots)", "MAX_NUM_SEQS")]
MaxBatched = Annotated[int, _opt("Token budget of one engine step", "MAX_NUM_BATCHED_TOKENS")]
AsyncSched = Annotated[bool, _opt("Schedule and launch each engine step before the previous step's tokens reach the "
                                  "host (off: finish every step first)", "ASYNC_SCHEDULING")]
CudaGraphs = Annotated[bool, _opt("CUDA only: replay decode steps from captured CUDA graphs", "CUDA_GRAPHS")]
MaxLen = Annotated[Optional[int], _opt("Context length (default: the model's, capped at 32768)", "MAX_MODEL_LEN")]
LoadFormat = Annotated[str, _opt("auto | safetensors | dummy (random weights at the real shapes)", "LOAD_FORMAT")]
Kernels = Annotated[Optional[str], _opt("Kernel backend: auto | torch | flashinfer | fla | op=backend,...", "KERNELS")]
Threads = Annotated[Optional[int], _opt("torch CPU threads per worker", "TORCH_THREADS")]
Transport = Annotated[str, _opt("How held state moves between workers: ucx", "TRANSPORT")]
UcxEH = Annotated[bool, _opt("UCX peer error handling (off lets UCX use shared memory / cuda_ipc)", "UCX_ERROR_HANDLING",
                             "--ucx-error-handling/--no-ucx-error-handling")]  # fmt: skip
LogLevel = Annotated[str, _opt("debug | info | warning | error", "LOG_LEVEL")]
TlsCert = Annotated[Optional[str], _opt("TLS certificate (PEM) for gRPC", "TLS_CERT")]
TlsKey = Annotated[Optional[str], _opt("TLS private key (PEM)", "TLS_KEY")]
TlsCa = Annotated[Optional[str], _opt("CA bundle (PEM) to trust for gRPC peers", "TLS_CA")]
LeaseTtl = Annotated[float, _opt("Prefill: seconds a held state waits to be pulled", "LEASE_TTL")]
MaxLeaseTtl = Annotated[float, _opt("Prefill: the longest lease TTL a caller may ask for (s)", "MAX_LEASE_TTL")]
TransferTimeout = Annotated[float, _opt("Deadline of one state transfer (s)", "TRANSFER_TIMEOUT")]
AdmissionTimeout = Annotated[float, _opt("Decode: how long a request may queue for pool space before it is refused "
                                         "as full (s)", "ADMISSION_TIMEOUT")]  # fmt: skip
SecretFile = Annotated[Optional[str], _opt("File holding the mesh secret shared by the router and its workers (default: "
                                         "$DELTAMESH_MESH_SECRET); the router makes it if it is missing",
                                         "MESH_SECRET_FILE")]  # fmt: skip
ApiKey = Annotated[Optional[str], _opt("Require this key on the REST /v1 routes and the gRPC client API", "API_KEY")]
TlsClientAuth = Annotated[bool, _opt("Mutual TLS: require and present client certificates", "TLS_CLIENT_AUTH",
                                     "--tls-client-auth")]  # fmt: skip


def _tls(cert, key, ca, client_auth):
    from deltamesh.services.common.tls import TlsSettings

    tls = TlsSettings(cert=cert, key=key, ca=ca, client_auth=client_auth)
    try:
        tls.check()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return tls


def _ports_free(command: str, host: str, ports: dict[str, int | None]) -> None:
    """Exit at once, in one line naming the port and its flag, when a fixed port is taken: before the model
    loads, not after it with the server's tracebacks."""
    for flag, port in ports.items():
        if not port:
            continue
        try:
            socket.create_server((host, port)).close()  # SO_REUSEADDR as the servers bind: TIME_WAIT is no clash
        except OSError as e:
            print(f"deltamesh {command}: cannot listen on {host}:{port} ({flag}): {os.strerror(e.errno)}",
                  file=sys.stderr)  # fmt: skip
            raise typer.Exit(2) from None


def _transport_known(name: str) -> None:
    from deltamesh.transfer import TRANSPORTS

    if name not in TRANSPORTS:
        raise typer.BadParameter(f"unknown transport {name!r}; transports: {', '.join(TRANSPORTS)}",
                                 param_hint="--transport")  # fmt: skip


def _mesh_secret(secret_file: str | None, create: bool = False):
    from deltamesh.services.common.auth import MissingSecret, load_mesh_secret

    try:
        return load_mesh_secret(secret_file, create)
    except MissingSecret as e:
        raise typer.BadParameter(str(e), param_hint="--mesh-secret-file / DELTAMESH_MESH_SECRET") from None


def _tls_args(cert, key, ca, client_auth) -> list[str]:
    args = []
    for flag, value in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        if value:
            args += [flag, value]
    return args + (["--tls-client-auth"] if client_auth else [])


def _engine(model, device, dtype, state_dtype, page_size, num_kv_pages, max_num_seqs, max_num_batched_tokens,
            max_model_len, load_format, kernels, torch_threads, async_scheduling, cuda_graphs):  # fmt: skip
    from deltamesh.engine import EngineConfig

    return EngineConfig(
        model=model, device=device, dtype=dtype, state_dtype=state_dtype, page_size=page_size,
        num_kv_pages=num_kv_pages, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, load_format=load_format, kernel_backend=kernels, torch_threads=torch_threads,
        async_scheduling=async_scheduling, cuda_graphs=cuda_graphs,
    )  # fmt: skip


def _run_worker(role: str, settings_kwargs: dict) -> None:
    from deltamesh.services.common.logs import configure_logging
    from deltamesh.services.common.server import run
    from deltamesh.services.common.settings import WorkerSettings, print_settings

    settings = WorkerSettings(role=role, **settings_kwargs)
    configure_logging(role, settings.log_level)
    print_settings(role, settings)
    if role == "prefill":
        from deltamesh.services.prefill.main import serve
    else:
        from deltamesh.services.decode.main import serve
    run(lambda stop: serve(settings, stop))


def _worker_command(role: str):
    def command(
        model: Model = str(DEFAULT_MODEL),
        device: Device = "cpu",
        host: Host = "127.0.0.1",
        port: Annotated[int, _opt("gRPC port (0: any free port)", "PORT")] = 0,
        router: Annotated[Optional[str], _opt("The router's control-plane address (its --control-port) to register "
                                              "with", "ROUTER")] = None,  # fmt: skip
        mesh_secret_file: SecretFile = None,
        advertise_host: Annotated[Optional[str], _opt("Host the router should dial (default: --host)",
                                                      "ADVERTISE_HOST")] = None,  # fmt: skip
        dtype: Dtype = "auto",
        state_dtype: StateDtype = "float32",
        page_size: PageSize = 16,
        num_kv_pages: NumPages = None,
        max_num_seqs: MaxSeqs = 32,
        max_num_batched_tokens: MaxBatched = 1024,
        max_model_len: MaxLen = None,
        load_format: LoadFormat = "auto",
        kernels: Kernels = None,
        torch_threads: Threads = None,
        async_scheduling: AsyncSched = True,
        cuda_graphs: CudaGraphs = True,
        transport: Transport = "ucx",
        ucx_error_handling: UcxEH = True,
        lease_ttl: LeaseTtl = 30.0,
        max_lease_ttl: MaxLeaseTtl = 300.0,
        transfer_timeout: TransferTimeout = 30.0,
        admission_timeout: AdmissionTimeout = 30.0,
        metrics_port: Annotated[Optional[int], _opt("Serve Prometheus /metrics on this port", "METRICS_PORT")] = None,
        tls_cert: TlsCert = None,
        tls_key: TlsKey = None,
        tls_ca: TlsCa = None,
        tls_client_auth: TlsClientAuth = False,
        log_level: LogLevel = "info",
    ) -> None:
        _ports_free(role, host, {"--port": port, "--metrics-port": metrics_port})
        _transport_known(transport)
        tls = _tls(tls_cert, tls_key, tls_ca, tls_client_auth)
        secret = _mesh_secret(mesh_secret_file)
        engine = _engine(model, device, dtype, state_dtype, page_size, num_kv_pages, max_num_seqs,
                         max_num_batched_tokens, max_model_len, load_format, kernels, torch_threads,
                         async_scheduling, cuda_graphs)  # fmt: skip
        _run_worker(role, dict(
            host=host, port=port, router=router, advertise_host=advertise_host, engine=engine, transport=transport,
            ucx_error_handling=ucx_error_handling,
            lease_ttl_s=lease_ttl, max_lease_ttl_s=max_lease_ttl, transfer_timeout_s=transfer_timeout,
            admission_timeout_s=admission_timeout,
            metrics_port=metrics_port, tls=tls, mesh_secret=secret, log_level=log_level,
        ))  # fmt: skip

    command.__doc__ = {
        "prefill": "Run a prefill worker: prefill prompts, hold their state under leases for decode workers.",
        "decode": "Run a decode worker: pull request state from prefill workers and decode in a continuous batch.",
        "colocated": "Run a colocated worker: prefill and decode its own requests (the aggregated baseline).",
    }[role]
    return command


for _role in ("prefill", "decode", "colocated"):
    app.command(_role)(_worker_command(_role))


@app.command()
def router(
    model: Model = str(DEFAULT_MODEL),
    host: Host = "127.0.0.1",
    grpc_port: Annotated[int, _opt("Router gRPC port of the client API", "GRPC_PORT")] = 50051,
    control_port: ControlPort = 50052,
    http_port: Annotated[Optional[int], _opt("OpenAI-compatible REST port (0: off)", "HTTP_PORT")] = 8000,
    prefill: Annotated[Optional[list[str]], _opt("Static prefill worker address (repeatable)", "PREFILL")] = None,
    decode: Annotated[Optional[list[str]], _opt("Static decode worker address (repeatable)", "DECODE")] = None,
    colocated: Annotated[Optional[list[str]], _opt("Static colocated worker address (repeatable)", "COLOCATED")] = None,
    policy: Annotated[str, _opt("round_robin | least_loaded", "POLICY")] = "least_loaded",
    max_model_len: MaxLen = None,
    api_key: ApiKey = None,
    mesh_secret_file: SecretFile = None,
    max_prompts: Annotated[int, _opt("Most prompts in one completions request", "MAX_PROMPTS")] = 1024,
    max_choices: Annotated[int, _opt("Most choices (prompts x n) in one request", "MAX_CHOICES")] = 1024,
    max_messages: Annotated[int, _opt("Most messages in one chat request", "MAX_MESSAGES")] = 4096,
    http_header_timeout: Annotated[float, _opt("Seconds a REST client has to send a request's headers",
                                               "HTTP_HEADER_TIMEOUT")] = 10.0,  # fmt: skip
    ready_timeout: Annotated[float, _opt("Seconds a request waits for the mesh to have workers (at start, or all "
                                         "restarting) before a 503 / UNAVAILABLE", "READY_TIMEOUT")] = 10.0,  # fmt: skip
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    tls_client_auth: TlsClientAuth = False,
    log_level: LogLevel = "info",
) -> None:
    """Run the router: gRPC client API, OpenAI-compatible REST gateway, and the workers' control plane."""
    _ports_free("router", host, {"--grpc-port": grpc_port, "--control-port": control_port, "--http-port": http_port})
    from deltamesh.services.common.logs import configure_logging
    from deltamesh.services.common.server import run
    from deltamesh.services.common.settings import RequestLimits, RouterSettings, print_settings
    from deltamesh.services.router.main import serve

    settings = RouterSettings(
        model=model, host=host, grpc_port=grpc_port, control_port=control_port,
        mesh_secret=_mesh_secret(mesh_secret_file, create=True), http_port=http_port or None, prefill=prefill or [],
        decode=decode or [], colocated=colocated or [], policy=policy, max_model_len=max_model_len,
        api_key=api_key, tls=_tls(tls_cert, tls_key, tls_ca, tls_client_auth), log_level=log_level,
        limits=RequestLimits(max_prompts=max_prompts, max_choices=max_choices, max_messages=max_messages),
        http_header_timeout_s=http_header_timeout, ready_timeout_s=ready_timeout,
    )  # fmt: skip
    configure_logging("router", settings.log_level)
    print_settings("router", settings)
    run(lambda stop: serve(settings, stop))


@app.command()
def health(
    address: Annotated[str, typer.Argument(help="host:port of a deltamesh service")],
    service: Annotated[str, typer.Option(help="Service name to check ('' = the whole server)")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds")] = 3.0,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    tls_client_auth: TlsClientAuth = False,
) -> None:
    """Exit 0 if the service answers the standard gRPC health check as SERVING (for container health checks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from deltamesh.services.common.tls import channel_credentials

    tls = _tls(tls_cert, tls_key, tls_ca, tls_client_auth)
    try:
        channel = grpc.secure_channel(address, channel_credentials(tls)) if tls.enabled else grpc.insecure_channel(address)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        raise typer.Exit(1) from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise typer.Exit(1)


@app.command()
def loads(
    control: Annotated[str, typer.Argument(help="The router's control plane (its --control-port)")] = "127.0.0.1:50052",
    mesh_secret_file: SecretFile = None,
) -> None:
    """Print every worker's load as the router sees it (JSON lines); needs the mesh secret."""
    import grpc
    from google.protobuf.json_format import MessageToJson

    from deltamesh.services.router.control import read_loads

    try:
        workers = read_loads(control, _mesh_secret(mesh_secret_file))
    except grpc.RpcError as e:
        print(f"{control}: {e.code().name}: {e.details()}", file=sys.stderr)
        raise typer.Exit(1) from None
    for load in workers:
        print(MessageToJson(load, indent=None, always_print_fields_with_no_presence=True))


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(host: str) -> int:
    """A free port below the ephemeral range. A worker keeps its ports across restarts, and a port from the
    ephemeral range (bind to port 0) can be taken by any process's next outgoing connection or port-0 listener
    (UCX's included) while its worker is starting or down; seen in practice as 'Address already in use'."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} below {low}")


@app.command()
def serve(
    model: Model = str(DEFAULT_MODEL),
    device: Device = "cpu",
    host: Host = "127.0.0.1",
    grpc_port: Annotated[int, _opt("Router gRPC port of the client API", "GRPC_PORT")] = 50051,
    control_port: ControlPort = 50052,
    http_port: Annotated[int, _opt("OpenAI-compatible REST port (0: off)", "HTTP_PORT")] = 8000,
    prefill_workers: Annotated[int, _opt("Prefill worker processes", "PREFILL_WORKERS")] = 1,
    decode_workers: Annotated[int, _opt("Decode worker processes", "DECODE_WORKERS")] = 1,
    colocated: Annotated[bool, _opt("Aggregated baseline: --decode-workers colocated workers prefill and decode "
                                    "their own requests (--prefill-workers is ignored)", "COLOCATED",
                                    "--colocated")] = False,  # fmt: skip
    gpus: Annotated[Optional[str], _opt("GPU ids to spread workers over, e.g. 0,1 (cuda only)", "GPUS")] = None,
    dtype: Dtype = "auto",
    state_dtype: StateDtype = "float32",
    page_size: PageSize = 16,
    num_kv_pages: NumPages = None,
    max_num_seqs: MaxSeqs = 32,
    max_num_batched_tokens: MaxBatched = 1024,
    max_model_len: MaxLen = None,
    load_format: LoadFormat = "auto",
    kernels: Kernels = None,
    async_scheduling: AsyncSched = True,
    cuda_graphs: CudaGraphs = True,
    transport: Transport = "ucx",
    ucx_error_handling: UcxEH = True,
    lease_ttl: LeaseTtl = 30.0,
    max_lease_ttl: MaxLeaseTtl = 300.0,
    transfer_timeout: TransferTimeout = 30.0,
    admission_timeout: AdmissionTimeout = 30.0,
    api_key: ApiKey = None,
    mesh_secret_file: SecretFile = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    tls_ca: TlsCa = None,
    tls_client_auth: TlsClientAuth = False,
    log_level: LogLevel = "info",
) -> None:
    """Start the mesh on one box: router + N prefill + M decode worker processes, each restarted if it exits.
    Ctrl-C stops them all."""
    _ports_free("serve", host, {"--grpc-port": grpc_port, "--control-port": control_port, "--http-port": http_port})
    _tls(tls_cert, tls_key, tls_ca, tls_client_auth)
    tls_args = _tls_args(tls_cert, tls_key, tls_ca, tls_client_auth)
    roles = ["colocated"] * decode_workers if colocated else ["prefill"] * prefill_workers + ["decode"] * decode_workers
    gpu_ids = (gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "0")).split(",")
    threads = max(1, (os.cpu_count() or 1) // len(roles))
    router_addr = f"{host}:{grpc_port}"
    control_addr = f"{host}:{control_port}"
    # one secret per mesh, made here unless given; children get it in their environment (never on a command line)
    has_secret = mesh_secret_file or os.environ.get("DELTAMESH_MESH_SECRET")
    secret = _mesh_secret(mesh_secret_file) if has_secret else secrets.token_urlsafe(32)
    common = ["--model", model, "--device", device, "--host", host, "--dtype", dtype, "--state-dtype", state_dtype,
              "--page-size", str(page_size), "--max-num-seqs", str(max_num_seqs),
              "--max-num-batched-tokens", str(max_num_batched_tokens), "--load-format", load_format,
              "--log-level", log_level, "--lease-ttl", str(lease_ttl), "--max-lease-ttl", str(max_lease_ttl),
              "--transfer-timeout", str(transfer_timeout), "--admission-timeout", str(admission_timeout),
              "--transport", transport, "--ucx-error-handling" if ucx_error_handling else "--no-ucx-error-handling",
              "--async-scheduling" if async_scheduling else "--no-async-scheduling",
              "--cuda-graphs" if cuda_graphs else "--no-cuda-graphs", *tls_args]  # fmt: skip
    for flag, value in (("--num-kv-pages", num_kv_pages), ("--max-model-len", max_model_len), ("--kernels", kernels)):
        if value is not None:
            common += [flag, str(value)]
    cli = [sys.executable, "-m", "deltamesh.services.cli"]
    # what every child gets: the mesh's secret travels in the environment, never on a command line
    base_env = {k: v for k, v in os.environ.items() if k != "DELTAMESH_MESH_SECRET_FILE"}
    base_env["DELTAMESH_MESH_SECRET"] = secret
    router_args = ["router", "--model", model, "--host", host, "--grpc-port", str(grpc_port),
                   "--control-port", str(control_port), "--http-port", str(http_port), "--log-level", log_level,
                   *tls_args]  # fmt: skip
    if max_model_len is not None:
        router_args += ["--max-model-len", str(max_model_len)]
    router_env = {**base_env, "DELTAMESH_API_KEY": api_key} if api_key else base_env
    specs = [ChildSpec("router", cli + router_args, router_env)]
    metrics_urls = []
    for i, role in enumerate(roles):
        env = base_env
        if device.startswith("cuda"):
            env = {**base_env, "CUDA_VISIBLE_DEVICES": gpu_ids[i % len(gpu_ids)]}
        # fixed ports, chosen once: a restarted worker comes back at the address the router knows it by
        metrics_port = _free_port(host)
        metrics_urls.append(f"{role} http://{host}:{metrics_port}/metrics")
        args = [role, *common, "--port", str(_free_port(host)), "--router", control_addr, "--metrics-port", str(metrics_port)]
        if device == "cpu":
            args += ["--torch-threads", str(threads)]
        specs.append(ChildSpec(f"{role}-{roles[:i].count(role)}", cli + args, env))

    print(f"deltamesh: router gRPC {router_addr}" + (f", REST http://{host}:{http_port}/v1" if http_port else "")
          + f"; metrics: {', '.join(metrics_urls)}", file=sys.stderr, flush=True)  # fmt: skip
    code = Supervisor(specs).run()
    if code:
        raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

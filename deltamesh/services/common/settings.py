"""One settings object per service, and the `deltamesh serve` settings; printed at start.

Every field with a description is a command-line option and a DELTAMESH_* environment variable of the commands
that use the model (deltamesh/services/common/options.py says how; json_schema_extra holds the option's metadata).
Fields without one are set only here."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic.json_schema import JsonDict

from deltamesh.engine.chat_template import RESERVED_VARIABLES, load_chat_template
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.protocol.generation_defaults import GenerationConfigSource, check_overrides, sampling_defaults
from deltamesh.protocol.sampling import MAX_LOGPROBS, SamplingParams
from deltamesh.services.common.tls import TlsSettings

Role = Literal["prefill", "decode", "colocated"]
_NO_OPTION: JsonDict = {"cli": False}
# a port setting's range is ge=0, le=65535 (0: any free port, or off where the field says so); written out in each
# Field, as type checkers read the arguments of a pydantic field only when they are spelled out


def _flag(name: str) -> JsonDict:
    """json_schema_extra of a field whose command-line option has another name than the field."""
    return {"flag": name}


def _engine_setting(name: str) -> Any:
    """The engine's setting `name` (default, help and flag names) on a service that takes it without running an
    engine."""
    (f,) = [f for f in dataclasses.fields(EngineConfig) if f.name == name]
    names: JsonDict | None = {"decls": list(f.metadata["decls"])} if "decls" in f.metadata else None
    return Field(f.default, description=f.metadata["help"], json_schema_extra=names)


class WorkerSettings(BaseModel):
    role: Role = Field(json_schema_extra=_NO_OPTION)  # the command
    host: str = Field("127.0.0.1", description="Address to bind (loopback unless told otherwise)")
    port: int = Field(0, ge=0, le=65535, description="gRPC port (0: any free port)")
    # registration and heartbeats
    router: str | None = Field(
        None,
        description="The router's control-plane address (its --control-port) to register with; several router hosts "
        "comma-separated (the worker also registers with every process of each: --api-server-count)",
    )
    # shared by the router and every worker of the mesh (deltamesh/services/common/auth.py); --mesh-secret-file
    mesh_secret: SecretStr = Field(json_schema_extra=_NO_OPTION)
    advertise_host: str | None = Field(None, description="Host the router should dial (default: --host)")
    served_model_name: list[str] | None = Field(
        None,
        description="The model's names in the API, as the router's (`serve` passes its own): the first labels "
        "vLLM's metric names (model_name; default: the checkpoint directory's name)",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # how held state moves between workers (deltamesh/transfer/registry.py)
    transport: str = Field("ucx", description="How held state moves between workers: ucx")
    # who can reach the side channel (deltamesh/transfer/ucx/__init__.py): this host's workers of this user only,
    # or also TCP on this interface (whoever reaches it can read the workers' memory)
    side_channel_interface: str | None = Field(
        None,
        description="Network interface the side channel may also use, to reach workers on other hosts (UCX over "
        "TCP: anyone who can connect to it can read the workers' memory, so only a network of the mesh's hosts). "
        "Unset: this host only (shared memory, CMA, CUDA IPC), workers of one user",
    )
    # off: UCX cannot report a dead peer (deadlines still end every pull)
    ucx_error_handling: bool = Field(True, description="UCX peer error handling (a dead peer ends a pull at once)")
    # prefill: how long a held state waits for its decode worker
    lease_ttl_s: float = Field(
        30.0, description="Prefill: seconds a held state waits to be pulled", json_schema_extra=_flag("lease_ttl")
    )
    # prefill: the longest TTL a caller may ask for (Prefill, ExtendLease)
    max_lease_ttl_s: float = Field(
        300.0,
        description="Prefill: the longest lease TTL a caller may ask for (s)",
        json_schema_extra=_flag("max_lease_ttl"),
    )
    # decode: deadline of one state pull
    transfer_timeout_s: float = Field(
        30.0, description="Deadline of one state transfer (s)", json_schema_extra=_flag("transfer_timeout")
    )
    # decode: how long a transferred request may wait for pool space
    admission_timeout_s: float = Field(
        30.0,
        description="Decode: how long a request may queue for pool space before it is refused as full (s)",
        json_schema_extra=_flag("admission_timeout"),
    )
    # Prometheus /metrics over HTTP (None: off)
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus /metrics on this port")
    tls: TlsSettings = Field(default_factory=TlsSettings, json_schema_extra={"prefix": "tls_"})
    log_level: str = Field("info", description="debug | info | warning | error")


class RequestLimits(BaseModel):
    """Caps on the size of one request at the router's edges, checked before any tokenising so that an
    oversized request is refused at once instead of stalling the router. The defaults are far above what a real
    client sends, yet each keeps one request's cheap pre-work (validating the JSON, counting) to milliseconds:"""

    # /v1/completions prompts in one request: batches are client-side conveniences of a few to a few hundred
    # prompts; 1024 leaves room and keeps one request's choices (below) in the same range.
    max_prompts: int = Field(1024, ge=1, description="Most prompts in one completions request")
    # prompts x n: every choice is a stream through the mesh, so this caps what one request may hold.
    max_choices: int = Field(1024, ge=1, description="Most choices (prompts x n) in one request")
    # chat messages: long agent transcripts reach hundreds; 4096 messages of one token each already pass the
    # context of most models, while validating a hundred thousand of them holds the router's loop noticeably.
    max_messages: int = Field(4096, ge=1, description="Most messages in one chat request")
    # Fair admission (deltamesh/services/router/gateway/fanout.py): workers serve requests in arrival order, so a
    # request whose choices all entered the mesh at once would queue every other client's request behind all of
    # them. Its choices start in turn instead, within two bounds. Prompt tokens waiting for their first token: what
    # one request can put ahead of another client's first token; 4096 is the CUDA engine step's token budget (four
    # steps on a CPU).
    max_prefilling_tokens: int = Field(
        4096,
        ge=1,
        description="Most prompt tokens of one request's choices waiting for their first token at once (a longer "
        "prompt goes alone): what one request can put ahead of other clients' first tokens",
    )
    # Choices in the mesh at once: 32, the workers' default --max-num-seqs, lets one request fill a worker's batch
    # and no more of the decode workers' queues.
    max_running_choices: int = Field(
        32, ge=1, description="Most choices of one request in the mesh at once (the rest start as they end)"
    )


def chat_template_defaults(variables: str | None) -> dict[str, Any]:
    """--default-chat-template-kwargs as a dict: a JSON object of template variables (ValueError otherwise)."""
    if variables is None:
        return {}
    try:
        value = json.loads(variables)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object of template variables")
    reserved = RESERVED_VARIABLES.intersection(value)
    if reserved:
        raise ValueError(f"cannot set {', '.join(sorted(reserved))}: a request's own fields set them")
    return value


def _worker_field(name: str) -> Any:
    """WorkerSettings' field `name` (default, description, metadata) for a router setting of the same meaning.
    Typed Any as _engine_setting is: the FieldInfo is the field's default to pydantic, not a value of its type."""
    return WorkerSettings.model_fields[name]


class RouterSettings(BaseModel):
    host: str = _worker_field("host")
    grpc_port: int = Field(50051, ge=0, le=65535, description="Router gRPC port of the client API")
    control_port: int = Field(
        50052,
        ge=0,
        le=65535,
        description="Router gRPC port of the control plane (workers register here; mesh secret required)",
    )
    mesh_secret: SecretStr = Field(json_schema_extra=_NO_OPTION)
    # OpenAI-compatible REST gateway (None: off); --port is vLLM's name for it (a worker's --port is its gRPC port,
    # but no command takes both)
    http_port: int | None = Field(
        8000,
        ge=0,
        le=65535,
        description="OpenAI-compatible REST port (0: off)",
        json_schema_extra={"decls": ["--http-port", "--port"]},
    )
    # several router processes (deltamesh/services/router/processes.py)
    api_server_count: int = Field(
        1,
        ge=1,
        description="Router processes sharing the gRPC and REST ports (SO_REUSEPORT), each with the whole mesh's "
        "view; process i's control plane listens on --control-port + i",
    )
    # set by the parent that started this process as one of --api-server-count router processes: its number
    process_index: int | None = Field(None, json_schema_extra=_NO_OPTION)
    # that parent's memory shared by its router processes (admission counts): a file descriptor this process inherited
    shared_counts_fd: int | None = Field(None, json_schema_extra=_NO_OPTION)
    model: str = _engine_setting("model")  # checkpoint directory: tokenizer, chat template, model id
    # vLLM's --chat-template, read as vLLM reads it (chat_template.load_chat_template): kept as given (a path, or a
    # template with its escapes), so that the router `serve` hands it to reads it the same way
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file, or the template itself, that renders chats instead of the "
        "checkpoint's (one line: \\n for a new line)",
    )
    generation_config: GenerationConfigSource = Field(
        "auto",
        description="auto: a request's unset temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
        "take the checkpoint's generation_config.json values (as vLLM's default); vllm: deltamesh's own defaults",
    )
    override_generation_config: str | None = Field(
        None,
        description="JSON object over the checkpoint's recommendation (vLLM's), in generation_config.json's names, "
        'e.g. \'{"temperature": 0.7, "max_new_tokens": 512}\'',
    )
    served_model_name: list[str] | None = Field(
        None,
        description="The model's names in the API (repeatable, or several after one flag, as vLLM takes them): "
        "/v1/models lists the first; requests may give any of them or the checkpoint path (default: the "
        "checkpoint directory's name)",
    )
    max_model_len: int | None = _engine_setting("max_model_len")
    # the workers' KV page size: the block the cache_aware policy and the P/D decider name prefixes by, as the
    # workers' prefix caches do
    page_size: int = _engine_setting("page_size")
    # static worker addresses
    prefill: list[str] = Field(default_factory=list, description="Static prefill worker address (repeatable)")
    decode: list[str] = Field(default_factory=list, description="Static decode worker address (repeatable)")
    colocated: list[str] = Field(default_factory=list, description="Static colocated worker address (repeatable)")
    policy: Literal["round_robin", "least_loaded", "cache_aware"] = Field(
        "cache_aware",
        description="round_robin | least_loaded | cache_aware (where the prompt's prefix went "
        "before, balanced against load: the workers' prefix caches hold them)",
    )
    pd_direct_max_tokens: int = Field(
        0,
        ge=0,
        description="Send a request straight to the decode worker that "
        "holds all but at most this many tokens of its prompt (a conversation's "
        "earlier turns, kept by decode workers' prefix caches). 0: off",
    )
    # router/admission.py: requests wait at the router for room on a decode worker, before their prefill
    max_queued_requests: int = Field(
        1024,
        ge=0,
        description="Requests that may wait at the router for room on a decode worker (P/D); one more is refused "
        "at once (429 / RESOURCE_EXHAUSTED). 0: no queue",
    )
    health_interval_s: float = Field(0.5, json_schema_extra=_NO_OPTION)
    heartbeat_interval_s: float = Field(1.0, json_schema_extra=_NO_OPTION)
    prefill_retries: int = Field(2, json_schema_extra=_NO_OPTION)
    request_timeout_s: float = Field(600.0, json_schema_extra=_NO_OPTION)
    # how long a request waits for the mesh to have workers before a 503
    ready_timeout_s: float = Field(
        10.0,
        description="Seconds a request waits for the mesh to have workers (at "
        "start, or all restarting) before a 503 / UNAVAILABLE",
        json_schema_extra=_flag("ready_timeout"),
    )
    api_key: str | None = Field(None, description="Require this key on the REST /v1 routes and the gRPC client API")
    # how the REST gateway reads a chat reply (vLLM's flags and names); auto: from the model's chat template
    tool_call_parser: Literal["auto", "qwen3_coder", "hermes", "none"] = Field(
        "auto",
        description="REST: how the model writes tool calls: qwen3_coder (Qwen3.5's XML form), hermes (Qwen3's "
        "JSON form), none; auto: read off the chat template",
    )
    reasoning_parser: Literal["auto", "qwen3", "none"] = Field(
        "auto",
        description="REST: qwen3 returns <think>...</think> as reasoning_content; auto: on when the chat "
        "template thinks",
    )
    # vLLM's: template variables a chat request leaves unset take these (Qwen3.5: '{"enable_thinking": false}')
    default_chat_template_kwargs: str | None = Field(
        None,
        description="Chat template variables (a JSON object) for every chat; a request's chat_template_kwargs "
        "override them, e.g. '{\"enable_thinking\": false}'",
    )
    max_logprobs: int = Field(
        MAX_LOGPROBS,
        description=f"Most logprobs, top_logprobs or prompt_logprobs a request may ask for (0-{MAX_LOGPROBS}; vLLM's "
        "-1, the whole vocabulary, is not served)",
    )
    log_requests: bool = Field(
        True,
        description="Log one line per request at its end (outcome, tokens, TTFT, seconds); vLLM's names for the "
        "switch: --enable-log-requests / --disable-log-requests",
        json_schema_extra={"decls": ["--enable-log-requests/--disable-log-requests"]},
    )
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "warning", description="The REST server's (uvicorn's) own log lines from this level up"
    )
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # Seconds a client has to send a request's line and headers once it connects or starts a request (idle
    # keep-alive connections are closed by uvicorn's own keep-alive timeout).
    http_header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a REST client has to send a request's headers",
        json_schema_extra=_flag("http_header_timeout"),
    )
    # Seconds a client has to send a request's whole body once its headers are in: a client that trickles a body
    # (a byte every few seconds) would otherwise hold its connection and request for ever. 30 s carries the
    # largest body (4 MiB) at 140 kB/s.
    http_body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a REST client has to send a request's body once its headers are in",
        json_schema_extra=_flag("http_body_timeout"),
    )
    tls: TlsSettings = _worker_field("tls")
    log_level: str = _worker_field("log_level")

    @field_validator("http_port")
    @classmethod
    def _zero_is_off(cls, port: int | None) -> int | None:
        return port or None

    @field_validator("max_logprobs")
    @classmethod
    def _logprobs_served(cls, n: int) -> int:
        if not 0 <= n <= MAX_LOGPROBS:
            raise ValueError(f"0 to {MAX_LOGPROBS}: deltamesh returns at most {MAX_LOGPROBS} (no whole-vocabulary -1)")
        return n

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _template_variables(cls, variables: str | None) -> str | None:
        if variables is not None:
            chat_template_defaults(variables)  # refused at start, not at every chat
        return variables

    @field_validator("chat_template")
    @classmethod
    def _template_parses(cls, template: str | None) -> str | None:
        if template is not None:
            load_chat_template(template)  # a template that does not parse stops the router at start, not at a chat
        return template

    @model_validator(mode="after")
    def _recommended_sampling_passes(self) -> RouterSettings:
        """The checkpoint's recommended sampling (--generation-config auto) by the requests' rule, at start: a bad
        value stops the router there rather than failing every request that leaves it unset."""
        overrides = self.generation_overrides()
        check_overrides(overrides)
        model = Path(self.model)
        defaults = sampling_defaults(model, self.generation_config, overrides) if model.is_dir() else {}
        if defaults:
            try:
                SamplingParams(**defaults).validate(ModelConfig.from_dir(model).vocab_size)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"the sampling defaults (generation_config.json, --override-generation-config) hold what a "
                    f"request may not set: {e} (--generation-config vllm leaves the file's out)"
                ) from None
        return self

    def generation_overrides(self) -> dict[str, Any]:
        """--override-generation-config as a dict (ValueError when it is not a JSON object)."""
        if self.override_generation_config is None:
            return {}
        try:
            overrides = json.loads(self.override_generation_config)
        except ValueError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        return overrides


class ServeSettings(BaseModel):
    """What `deltamesh serve` adds to its router's and workers' settings: which processes to start."""

    prefill_workers: int = Field(1, ge=0, description="Prefill worker processes")
    decode_workers: int = Field(1, ge=1, description="Decode worker processes")
    colocated: bool = Field(
        False,
        description="Aggregated baseline: --decode-workers colocated workers prefill and "
        "decode their own requests (--prefill-workers is ignored)",
        json_schema_extra={"decls": ["--colocated"]},
    )
    gpus: str | None = Field(
        None, description="GPU ids to spread workers over, e.g. 0,1 (cuda only; 0 with 1P+1D: both on GPU 0)"
    )
    # each role's own memory budget on the GPU (engine/memory_budget.py), over --gpu-memory-utilization /
    # --kv-cache-memory-gb: a decode worker wants KV cache, a prefill worker little beyond the states it holds
    prefill_gpu_memory_utilization: float | None = Field(
        None, description="Prefill workers' --gpu-memory-utilization (default: --gpu-memory-utilization)"
    )
    decode_gpu_memory_utilization: float | None = Field(
        None, description="Decode workers' --gpu-memory-utilization (default: --gpu-memory-utilization)"
    )
    prefill_kv_cache_memory_gb: float | None = Field(
        None, description="Prefill workers' --kv-cache-memory-gb (default: --kv-cache-memory-gb)"
    )
    decode_kv_cache_memory_gb: float | None = Field(
        None, description="Decode workers' --kv-cache-memory-gb (default: --kv-cache-memory-gb)"
    )
    # a firewall or a Prometheus configuration names the workers' ports: fixed ones, in a block of their own
    worker_port_base: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Workers' ports from this one up, two per worker in start order (prefill workers, then decode): "
        "worker i's gRPC port is BASE+2i, its metrics port BASE+2i+1 (default: free ports chosen at start)",
    )

    @model_validator(mode="after")
    def _workers_that_can_serve(self) -> ServeSettings:
        # a mesh of decode workers alone would take every request and answer none (no prefill worker to hand
        # them their state)
        if self.prefill_workers == 0 and not self.colocated:
            raise ValueError(
                "--prefill-workers 0 leaves the decode workers nothing to decode: give at least 1, or --colocated "
                "for workers that prefill and decode their own requests"
            )
        last = self.worker_port_base + 2 * self.num_workers - 1 if self.worker_port_base else 0
        if last > 65535:
            raise ValueError(
                f"--worker-port-base {self.worker_port_base}: {self.num_workers} workers need ports up to {last}; "
                "ports end at 65535"
            )
        return self

    @property
    def roles(self) -> list[str]:
        """One role per worker, in start order."""
        if self.colocated:
            return ["colocated"] * self.decode_workers
        return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers

    @property
    def num_workers(self) -> int:
        return len(self.roles)

    def worker_ports(self, index: int) -> tuple[int, int] | None:
        """(gRPC, metrics) port of the `index`-th worker under --worker-port-base; None without it."""
        if self.worker_port_base is None:
            return None
        return self.worker_port_base + 2 * index, self.worker_port_base + 2 * index + 1


def print_settings(name: str, settings: BaseModel) -> None:
    data = settings.model_dump(mode="json")  # SecretStr fields print as stars
    if data.get("api_key"):
        data["api_key"] = "***"  # never log secrets
    sys.stderr.write(json.dumps({"service": name, "settings": data}, default=str) + "\n")  # one write: see logs.py
    sys.stderr.flush()

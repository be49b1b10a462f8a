"""One settings object per service, filled from CLI flags and DELTAMESH_* environment variables (see
deltamesh/services/cli.py) and printed at start."""

from __future__ import annotations

import json
import sys
from typing import Literal

from pydantic import BaseModel, Field, SecretStr

from deltamesh.engine import EngineConfig
from deltamesh.services.common.tls import TlsSettings

Role = Literal["prefill", "decode", "colocated"]


class WorkerSettings(BaseModel):
    role: Role
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    router: str | None = None  # the router's control-plane address to register with (heartbeats)
    mesh_secret: SecretStr  # shared by the router and every worker of the mesh (deltamesh/services/common/auth.py)
    advertise_host: str | None = None  # host the router should dial (default: the bind host)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    transport: str = "ucx"  # how held state moves between workers (deltamesh/transfer/registry.py)
    ucx_error_handling: bool = True  # False lets UCX use shared memory / cuda_ipc, but peer failures go undetected by UCX
    lease_ttl_s: float = 30.0  # prefill: how long a held state waits for its decode worker
    max_lease_ttl_s: float = 300.0  # prefill: the longest TTL a caller may ask for (Prefill, ExtendLease)
    transfer_timeout_s: float = 30.0  # decode: deadline of one state pull
    admission_timeout_s: float = 30.0  # decode: how long a transferred request may wait for pool space
    metrics_port: int | None = None  # Prometheus /metrics over HTTP (None: off)
    tls: TlsSettings = Field(default_factory=TlsSettings)
    log_level: str = "info"


class RequestLimits(BaseModel):
    """Caps on the size of one request at the router's edges, checked before any tokenising so that an
    oversized request is refused at once instead of stalling the router. The defaults are far above what a real
    client sends, yet each keeps one request's cheap pre-work (validating the JSON, counting) to milliseconds:"""

    # /v1/completions prompts in one request: batches are client-side conveniences of a few to a few hundred
    # prompts; 1024 leaves room and keeps one request's choices (below) in the same range.
    max_prompts: int = Field(1024, ge=1)
    # prompts x n: every choice is a stream through the mesh, so this caps what one request may hold.
    max_choices: int = Field(1024, ge=1)
    # chat messages: long agent transcripts reach hundreds; 4096 messages of one token each already pass the
    # context of most models, while validating a hundred thousand of them holds the router's loop noticeably.
    max_messages: int = Field(4096, ge=1)


class RouterSettings(BaseModel):
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # the client API
    control_port: int = 50052  # the control plane: worker registration and loads (mesh secret required)
    mesh_secret: SecretStr
    http_port: int | None = 8000  # OpenAI-compatible REST gateway (None: off)
    model: str = EngineConfig().model  # checkpoint directory: tokenizer, chat template, model id
    max_model_len: int | None = None
    prefill: list[str] = Field(default_factory=list)  # static worker addresses
    decode: list[str] = Field(default_factory=list)
    colocated: list[str] = Field(default_factory=list)
    policy: Literal["round_robin", "least_loaded"] = "least_loaded"
    health_interval_s: float = 0.5
    heartbeat_interval_s: float = 1.0
    prefill_retries: int = 2
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 10.0  # how long a request waits for the mesh to have workers before a 503
    api_key: str | None = None
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # Seconds a client has to send a request's line and headers once it connects or starts a request (idle
    # keep-alive connections are closed by uvicorn's own keep-alive timeout).
    http_header_timeout_s: float = Field(10.0, gt=0)
    tls: TlsSettings = Field(default_factory=TlsSettings)
    log_level: str = "info"


def print_settings(name: str, settings: BaseModel) -> None:
    data = settings.model_dump(mode="json")  # SecretStr fields print as stars
    if data.get("api_key"):
        data["api_key"] = "***"  # never log secrets
    sys.stderr.write(json.dumps({"service": name, "settings": data}, default=str) + "\n")  # one write: see logs.py
    sys.stderr.flush()


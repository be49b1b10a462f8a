"""Who may call what: the mesh secret on the control plane and the workers' ports, the API key on the router's
client API.

The router and every worker of one mesh share a secret (`deltamesh serve` makes one per mesh; a deployment by
hand sets `DELTAMESH_MESH_SECRET` or `--mesh-secret-file` on each process). Every call between them carries it
in metadata, and their servers refuse any call without it but the standard health checks. Clients never see it:
they reach only the router's client API, guarded by the API key when one is set. The secret travels as a bearer
value, so off one host the mesh's gRPC must run over TLS (`--tls-*`)."""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

import grpc

MESH_SECRET_KEY = "deltamesh-mesh-secret"
MESH_SECRET_ENV = "DELTAMESH_MESH_SECRET"
MIN_SECRET_CHARS = 16
# Health checks stay open: container health checks and load balancers ask them without credentials.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class MissingSecret(ValueError):
    pass


def load_mesh_secret(secret_file: str | None = None, create: bool = False) -> str:
    """The mesh secret from `secret_file`, else from $DELTAMESH_MESH_SECRET; raises MissingSecret with what to do.
    With `create` (the router) a missing file is made with a new random secret, readable by its owner only, for
    workers that share the file (docker-compose: a volume)."""
    if secret_file and create and not Path(secret_file).exists():
        _write_new_secret(Path(secret_file))
    if secret_file:
        secret = read_secret_file(secret_file, "mesh secret")
    else:
        secret = os.environ.get(MESH_SECRET_ENV, "").strip()
    if not secret:
        raise MissingSecret(
            "the router and its workers need a shared mesh secret: set DELTAMESH_MESH_SECRET (or "
            "--mesh-secret-file) to the same value on every process of the mesh, e.g. "
            "`export DELTAMESH_MESH_SECRET=$(openssl rand -hex 32)`; `deltamesh serve` makes one by itself"
        )
    if len(secret) < MIN_SECRET_CHARS:
        raise MissingSecret(f"the mesh secret is too short ({len(secret)} characters; at least {MIN_SECRET_CHARS})")
    return secret


def read_secret_file(path: str, what: str) -> str:
    """The stripped contents of the file holding a secret (`what`: "mesh secret", "API key"); MissingSecret, in
    one line, when it cannot be read or when its group or others may write it: whoever can write the file can
    put in a secret of their own, which the next process started with it would take (a mesh secret: the key to
    join the mesh)."""
    try:
        with open(path, "rb") as f:  # the mode of the file read, not of whatever the path names a moment later
            mode = os.fstat(f.fileno()).st_mode
            text = f.read().decode(errors="replace").strip()
    except OSError as e:
        raise MissingSecret(f"cannot read the {what} file {path}: {e.strerror}") from None
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise MissingSecret(
            f"the {what} file {path} is writable by {'others' if mode & stat.S_IWOTH else 'its group'} "
            f"({stat.filemode(mode)}), who could replace the {what}: make it writable by its owner only "
            f"(chmod go-w {path})"
        )
    return text


def _write_new_secret(path: Path) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made by another process meanwhile: use that one
        return
    except OSError as e:
        raise MissingSecret(f"cannot create the mesh secret file {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))


def mesh_metadata(secret: str, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata of a call to another process of the mesh (with the request id that ties its log lines together)."""
    from deltamesh.services.common.logs import REQUEST_ID_KEY

    pairs = ((MESH_SECRET_KEY, secret),)
    return pairs + ((REQUEST_ID_KEY, request_id),) if request_id else pairs


class RequireMetadata(grpc.aio.ServerInterceptor):
    """Refuses every call (health checks excepted) whose metadata lacks `key` with the value `expected`
    (compared in constant time), as UNAUTHENTICATED before the handler runs."""

    def __init__(self, key: str, expected: str, refusal: str):
        self.key, self.expected, self.refusal = key, expected.encode(), refusal

    def allows(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == self.key:
                return hmac.compare_digest(value.encode() if isinstance(value, str) else value, self.expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES) or self.allows(details.invocation_metadata):
            return handler  # (None: an unknown method, which gRPC answers UNIMPLEMENTED)
        return _refusing(handler, self.refusal)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses the call (its request is not parsed)."""

    async def refuse_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(refuse_stream if handler.response_streaming else refuse_unary)


def mesh_interceptor(secret: str) -> RequireMetadata:
    return RequireMetadata(
        MESH_SECRET_KEY, secret, "this port serves the mesh's own processes only (no or a wrong mesh secret)"
    )


def api_key_interceptor(api_key: str) -> RequireMetadata:
    return RequireMetadata(
        "authorization",
        f"Bearer {api_key}",
        "incorrect or missing API key (send 'authorization: Bearer <key>' metadata)",
    )

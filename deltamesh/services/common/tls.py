"""TLS (and optional mutual TLS) for every gRPC server and channel of the mesh.

One set of files per process: its certificate and key (its identity as a server, and as a client when
mutual TLS is on) and the CA bundle it trusts. With `client_auth`, servers require a client certificate
signed by that CA."""

from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import BaseModel, Field


class TlsSettings(BaseModel):
    cert: str | None = Field(None, description="TLS certificate (PEM) for gRPC")  # PEM certificate chain
    key: str | None = Field(None, description="TLS private key (PEM)")
    ca: str | None = Field(None, description="CA bundle (PEM) to trust for gRPC peers")  # peers' certificates
    client_auth: bool = Field(
        False,
        description="Mutual TLS: require and present client certificates",
        json_schema_extra={"decls": ["--tls-client-auth"]},
    )

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def check(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.client_auth and not (self.cert and self.ca):
            raise ValueError("mutual TLS needs --tls-cert, --tls-key and --tls-ca")
        for path in (self.cert, self.key, self.ca):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))], root_certificates=_read(tls.ca), require_client_auth=tls.client_auth
    )


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    with_identity = tls.client_auth and tls.cert
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca),
        private_key=_read(tls.key) if with_identity else None,
        certificate_chain=_read(tls.cert) if with_identity else None,
    )


def aio_channel(address: str, tls: TlsSettings | None, options) -> grpc.aio.Channel:
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.aio.insecure_channel(address, options=options)

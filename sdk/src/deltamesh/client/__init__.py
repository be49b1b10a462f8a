"""deltamesh gRPC client SDK."""

from deltamesh.client.client import AsyncClient, AsyncStream, Client, Stream, build_request
from deltamesh.client.errors import (
    Cancelled,
    DeadlineExceeded,
    DeltameshError,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PermissionDenied,
    Unavailable,
)
from deltamesh.client.types import ChatDelta, Delta, Model, Result, TokenLogprob, ToolCall, ToolCallDelta, Usage

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Cancelled",
    "ChatDelta",
    "Client",
    "DeadlineExceeded",
    "Delta",
    "DeltameshError",
    "InternalError",
    "InvalidRequest",
    "Model",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "Result",
    "Stream",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "Unavailable",
    "Usage",
    "build_request",
]

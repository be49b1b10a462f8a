"""Typed errors, one per gRPC status a caller may want to handle differently."""

from __future__ import annotations

import grpc


class DeltameshError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class InvalidRequest(DeltameshError):
    """Bad parameters or prompt (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE)."""


class NotFound(DeltameshError):
    """Unknown model or request id."""


class Unavailable(DeltameshError):
    """No worker (or the router) is reachable right now; safe to retry later."""


class Overloaded(DeltameshError):
    """The mesh is full (RESOURCE_EXHAUSTED); retry with backoff."""


class DeadlineExceeded(DeltameshError):
    pass


class Cancelled(DeltameshError):
    pass


class PermissionDenied(DeltameshError):
    """No or a wrong API key (UNAUTHENTICATED), or an abort without the request's abort token (PERMISSION_DENIED)."""


class InternalError(DeltameshError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def from_rpc_error(e: grpc.RpcError) -> DeltameshError:
    code = e.code()
    return _BY_CODE.get(code, InternalError)(code, e.details() or "")

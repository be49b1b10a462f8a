"""OpenAI-shaped errors: the `ApiError` every part of the gateway raises, the HTTP status of each mesh (gRPC)
error, and the app's exception handlers, which turn whatever a request raises into OpenAI's JSON error body."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltamesh.protocol.requests import RequestError
from deltamesh.protocol.sampling import SamplingParams
from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.limits import InvalidParam
from deltamesh.services.router.mesh import MeshError

log = structlog.get_logger("deltamesh.gateway")

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": oa.ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 502, 503)
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.detail = status, oa.ErrorDetail(message=message, type=type_, param=param, code=code)

    @classmethod
    def from_mesh(cls, e: MeshError) -> ApiError:
        status, kind = _HTTP_STATUS.get(e.code, (500, "server_error"))
        return cls(status, e.message, kind)

    def response(self) -> JSONResponse:
        headers = None
        if self.status in (429, 503):  # nothing to serve with yet (503), or no room for the request now (429)
            headers = {"Retry-After": "1"}  # come back soon
        elif self.status in (408, 413):  # the rest of the body goes unread: close, rather than read it to the end
            headers = {"Connection": "close"}
        return _AsciiJSON(oa.ErrorResponse(error=self.detail).model_dump(), status_code=self.status, headers=headers)


class _AsciiJSON(JSONResponse):
    """Error bodies escape non-ASCII: a message that quotes the client's input (a lone surrogate, say) can
    always be encoded."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class BodyTooLarge(Exception):
    """A body sent without Content-Length (chunked) passed the size limit while it was being read."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self.limit = limit


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over {limit} bytes")


class BodySlow(Exception):
    """A request's body did not all arrive within the deadline (--http-body-timeout)."""

    def __init__(self, timeout_s: float):
        super().__init__(timeout_s)
        self.timeout_s = timeout_s


def body_slow(timeout_s: float) -> ApiError:
    return ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout")


@contextlib.contextmanager
def as_api_error(param: str | None):
    """A request the frontend or the engine refuses is the client's error: 400 naming the parameter (the one the
    error names itself, else `param`)."""
    try:
        yield
    except RequestError as e:
        code = "context_length_exceeded" if "context length" in str(e) else None
        raise ApiError(400, str(e), param=getattr(e, "param", None) or param, code=code) from None


async def _api_error(request: Request, e: ApiError):
    return e.response()


async def _too_large(request: Request, e: BodyTooLarge):
    return body_too_large(e.limit).response()


async def _slow(request: Request, e: BodySlow):
    return body_slow(e.timeout_s).response()


# REST fields whose bounds the engine's own check (SamplingParams.validate) also enforces: a bad value gets that
# check's message, the one the gRPC API gives for the same value.
_SHARED_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_tokens": "min_tokens",
}


def _shared_message(loc: list[str], value) -> str | None:
    attr = _SHARED_FIELDS.get(loc[0]) if len(loc) == 1 else None
    if attr is None:
        return None
    try:
        SamplingParams(**{attr: value}).validate(vocab_size=1)
    except ValueError as e:
        return str(e)
    except TypeError:  # not even a number: the schema's own message says so
        return None
    return None


async def _invalid(request: Request, e: RequestValidationError):
    err = e.errors()[0] if e.errors() else {}
    if err.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}").response()
    refused = err.get("ctx", {}).get("error")
    if isinstance(refused, InvalidParam):  # the router's own rule, raised in a schema validator: as gRPC says it
        return ApiError(400, str(refused), param=refused.param).response()
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if not loc and "json" not in request.headers.get("content-type", ""):  # FastAPI read it as a plain string
        return ApiError(
            400, "the request body must be a JSON object sent with 'Content-Type: application/json'"
        ).response()
    shared = _shared_message(loc, err.get("input"))
    if shared is not None:
        return ApiError(400, shared, param=loc[-1]).response()
    if err.get("type") == "extra_forbidden":  # OpenAI's wording for a parameter it does not know
        return ApiError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}", param=".".join(loc)).response()
    message = err.get("msg", "invalid request").removeprefix("Value error, ")  # our validators' own words
    return ApiError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}", param=".".join(loc) or None).response()


async def _http_error(request: Request, e: StarletteHTTPException):
    if isinstance(e.__cause__, BodyTooLarge):  # FastAPI wraps errors raised while reading the body
        return await _too_large(request, e.__cause__)
    if isinstance(e.__cause__, BodySlow):
        return await _slow(request, e.__cause__)
    return ApiError(e.status_code, str(e.detail), "invalid_request_error").response()


async def _bug(request: Request, e: Exception):  # details go to the log, never to the client
    log.exception("request failed", path=request.url.path)
    return ApiError(500, "internal error", "server_error").response()


def add_error_handlers(app: FastAPI) -> None:
    handlers: dict[type[Exception], Callable[..., Any]] = {
        ApiError: _api_error,
        BodyTooLarge: _too_large,
        BodySlow: _slow,
        RequestValidationError: _invalid,
        StarletteHTTPException: _http_error,
        Exception: _bug,
    }
    for exception, handler in handlers.items():
        app.add_exception_handler(exception, handler)

"""ASGI middleware of the gateway: the API key and the request-size and body-time checks on /v1 routes and on
vLLM's token routes beside them."""

from __future__ import annotations

import asyncio

from deltamesh.services.common.settings import RequestLimits
from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.errors import ApiError, BodySlow, BodyTooLarge, body_too_large
from deltamesh.services.router.limits import MAX_REQUEST_BYTES

# vLLM serves these outside /v1 (and leaves them without its key), but they read a body and run the tokenizer on
# it as /v1's routes do: guarded alike. /health, /version and the rest read nothing and stay open.
_GUARDED_OUTSIDE_V1 = frozenset({"/tokenize", "/detokenize"})


class LimitsAndAuth:
    """API key, body-size and request-size checks on /v1 routes and the token routes, and the deadline of a
    request's body. Plain ASGI (not BaseHTTPMiddleware) so that handlers still see the client's disconnect, which
    aborts its request in the mesh."""

    def __init__(self, app, api_key: str | None, limits: RequestLimits, body_timeout_s: float = 30.0):
        self.app, self.api_key, self.limits, self.body_timeout_s = app, api_key, limits, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _guarded(scope["path"]):
            oa.LIMITS.set(self.limits)  # for the request schema's counts
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"").strip()
            error = None
            if self.api_key and headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
                error = ApiError(
                    401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
                )
            elif length.isdigit() and int(length) > MAX_REQUEST_BYTES:
                error = body_too_large(MAX_REQUEST_BYTES)
            if error is not None:
                return await error.response()(scope, receive, send)
            return await self.app(scope, _bounded(receive, self.body_timeout_s), send)
        return await self.app(scope, receive, send)


def _guarded(path: str) -> bool:
    return path.startswith("/v1") or path in _GUARDED_OUTSIDE_V1


def _bounded(receive, timeout_s: float):
    """A receive that stops a body without Content-Length (chunked) once it passes the size limit, and a body that
    is not all in `timeout_s` after the headers (uvicorn calls the app once they are in); once the body is in,
    receive as it was (a handler waits on it for the client's disconnect)."""
    received, body_done = 0, False
    deadline = asyncio.get_running_loop().time() + timeout_s

    async def bounded():
        nonlocal received, body_done
        if body_done:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
        except TimeoutError:
            raise BodySlow(timeout_s) from None
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > MAX_REQUEST_BYTES:
                raise BodyTooLarge(MAX_REQUEST_BYTES)
        body_done = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return bounded

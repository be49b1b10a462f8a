"""ASGI middleware of the gateway: the API key and the request-size checks on /v1 routes."""

from __future__ import annotations

from deltamesh.services.common.settings import RequestLimits
from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.errors import ApiError, BodyTooLarge, body_too_large

MAX_BODY_BYTES = 4 << 20


class LimitsAndAuth:
    """API key, body-size and request-size checks on /v1 routes. Plain ASGI (not BaseHTTPMiddleware) so that
    handlers still see the client's disconnect, which aborts its request in the mesh."""

    def __init__(self, app, api_key: str | None, limits: RequestLimits):
        self.app, self.api_key, self.limits = app, api_key, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            oa.LIMITS.set(self.limits)  # for the request schema's counts
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"").strip()
            error = None
            if self.api_key and headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
                error = ApiError(
                    401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
                )
            elif length.isdigit() and int(length) > MAX_BODY_BYTES:
                error = body_too_large(MAX_BODY_BYTES)
            if error is not None:
                return await error.response()(scope, receive, send)
            return await self.app(scope, _capped(receive), send)
        return await self.app(scope, receive, send)


def _capped(receive):
    """A receive that stops a body without Content-Length (chunked) once it passes the limit."""
    received = 0

    async def capped():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise BodyTooLarge(MAX_BODY_BYTES)
        return message

    return capped

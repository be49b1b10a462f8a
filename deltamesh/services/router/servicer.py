"""The router's gRPC front door."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import uuid

import grpc
import structlog

from deltamesh.engine import RequestError
from deltamesh.services.common.convert import sampling_from_proto
from deltamesh.services.common.logs import bind_request, request_id_from
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.mesh import Mesh, MeshError
from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = structlog.get_logger("deltamesh.router")


def new_request_id() -> str:
    return uuid.uuid4().hex


class AbortTokens:
    """A request's abort token is a MAC of its id under a key that never leaves this process: only the client that
    received the token with the request's first response can abort it, and nothing needs to be stored."""

    def __init__(self):
        self._key = secrets.token_bytes(32)

    def token(self, request_id: str) -> bytes:
        return hmac.new(self._key, request_id.encode(), hashlib.sha256).digest()[:16]

    def valid(self, request_id: str, token: bytes) -> bool:
        return hmac.compare_digest(self.token(request_id), token)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, mesh: Mesh):
        self.frontend, self.mesh = frontend, mesh
        self.abort_tokens = AbortTokens()

    async def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """Size checks first, on the loop and before copying anything out of the message; then tokenising
        or templating off the loop."""
        f = self.frontend
        kind = request.WhichOneof("prompt")
        if kind == "text":
            f.check_text(request.text)
            return (await f.off_loop(f.encode_texts, [request.text]))[0]
        if kind == "token_ids":
            f.check_token_count(len(request.token_ids.ids))
            return list(request.token_ids.ids)
        if kind == "chat":
            f.check_count(len(request.chat.messages), f.limits.max_messages, "chat messages")
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            f.check_chat(messages)
            return await f.off_loop(f.encode_chat, messages)
        raise RequestError("a prompt is required (text, token_ids or chat)")

    async def Generate(self, request: router_pb2.GenerateRequest, context):
        rid = request.request_id or request_id_from(context) or new_request_id()
        bind_request(rid)
        if request.model and request.model != self.frontend.model_id:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model {request.model[:200]!r} is not served here (serving {self.frontend.model_id!r})",
            )
        try:
            params = sampling_from_proto(request.sampling, request.stop)
            params.validate(self.frontend.vocab_size)  # before the prompt: it is cheap and may refuse at once
            prompt_ids = await self._prompt_ids(request)
            self.frontend.check(prompt_ids, params)
        except (ValueError, RequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            abort_token = self.abort_tokens.token(rid)  # in the first response only
            async with contextlib.aclosing(self.mesh.generate(rid, prompt_ids, params)) as deltas:
                async for delta in deltas:
                    yield router_pb2.GenerateResponse(request_id=rid, delta=delta, abort_token=abort_token)
                    abort_token = b""
        except MeshError as e:
            log.warning("request failed", code=e.code.name, error=e.message)
            await context.abort(e.code, e.message)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        if not self.abort_tokens.valid(request.request_id, request.abort_token):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "a request is aborted with the abort token of its first response (or by cancelling its Generate call)",
            )
        return common_pb2.AbortResponse(found=self.mesh.abort(request.request_id))

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        f = self.frontend
        return router_pb2.ListModelsResponse(
            models=[router_pb2.Model(id=f.model_id, max_model_len=f.max_model_len, vocab_size=f.vocab_size)]
        )

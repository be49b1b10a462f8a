"""The router's gRPC front door."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import uuid

import grpc
import structlog

from deltamesh.protocol.requests import RequestError
from deltamesh.protocol.sampling import SamplingParams
from deltamesh.services.common.convert import sampling_from_proto
from deltamesh.services.common.logs import bind_request, request_id_from, request_id_problem
from deltamesh.services.router.chat_output import ChatOutput, OutputDelta, OutputFormat
from deltamesh.services.router.chat_reply import plan_chat_reply
from deltamesh.services.router.chat_request import ChatRequest
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.limits import check_count, check_logit_bias_count, check_request_id, check_stop
from deltamesh.services.router.mesh import Mesh, MeshError
from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = structlog.get_logger("deltamesh.router")


def new_request_id() -> str:
    return uuid.uuid4().hex


def _chat_delta(part: OutputDelta) -> router_pb2.ChatDelta:
    return router_pb2.ChatDelta(
        reasoning=part.reasoning,
        content=part.content,
        tool_calls=[
            router_pb2.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "", arguments=c.arguments)
            for c in part.calls
        ],
    )


class AbortTokens:
    """A request's abort token is a nonce drawn for this run of the request and a MAC of the id and the nonce under
    a key that never leaves this process. The MAC tells a token this router issued from a forged one; the nonce,
    held by the running request (Mesh), makes the token abort that run only. A client chooses its request ids
    ("job-42"), so a token bound to the id alone would abort every later request that reuses it."""

    NONCE_BYTES = 16

    def __init__(self):
        self._key = secrets.token_bytes(32)

    def _mac(self, request_id: str, nonce: bytes) -> bytes:
        return hmac.new(self._key, request_id.encode() + b"\0" + nonce, hashlib.sha256).digest()[:16]

    def issue(self, request_id: str) -> tuple[bytes, bytes]:
        """(nonce, token) for a new run of `request_id`."""
        nonce = secrets.token_bytes(self.NONCE_BYTES)
        return nonce, nonce + self._mac(request_id, nonce)

    def nonce(self, request_id: str, token: bytes) -> bytes | None:
        """The nonce of a token this router issued for `request_id`, else None."""
        nonce, mac = token[: self.NONCE_BYTES], token[self.NONCE_BYTES :]
        if len(nonce) != self.NONCE_BYTES or not hmac.compare_digest(self._mac(request_id, nonce), mac):
            return None
        return nonce


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, mesh: Mesh, output_format: OutputFormat):
        self.frontend, self.mesh = frontend, mesh
        self.output_format = output_format  # how the model writes reasoning and tool calls
        self.abort_tokens = AbortTokens()

    async def _prompt(
        self, request: router_pb2.GenerateRequest, params: SamplingParams
    ) -> tuple[list[int], ChatOutput | None]:
        """The prompt's token ids, and for a chat the parser of its reply. Size checks first, on the loop and before
        copying anything out of the message; then tokenising or templating off the loop. A chat's forced
        tool_choice sets `params.structured_outputs` (the rules are REST's: chat_reply.py)."""
        f = self.frontend
        kind = request.WhichOneof("prompt")
        if kind == "text":
            f.check_text(request.text)
            return (await f.off_loop(f.encode_texts, [request.text]))[0], None
        if kind == "token_ids":
            f.check_token_count(len(request.token_ids.ids))
            return list(request.token_ids.ids), None
        if kind == "chat":
            check_count(len(request.chat.messages), f.limits.max_messages, "chat messages", "messages")
            chat = ChatRequest.from_proto(request.chat)
            f.check_chat(chat)
            plan = plan_chat_reply(chat, self.output_format, params.structured_outputs is not None)
            if plan.forced is not None:
                params.structured_outputs = plan.forced
            prompt = await f.off_loop(f.encode_chat, chat, plan.parsed)
            return prompt.ids, plan.new_output(prompt.assistant_prefix)
        raise RequestError("a prompt is required (text, token_ids or chat)")

    async def Generate(self, request: router_pb2.GenerateRequest, context):
        rid = request.request_id or request_id_from(context) or new_request_id()
        try:  # the id first: it goes into log lines and metadata; then the cheap checks, then the prompt
            check_request_id(rid)
            bind_request(rid)
            if not self.frontend.serves(request.model):
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"model {request.model[:200]!r} is not served here (serving {self.frontend.model_id!r})",
                )
            check_stop(request.stop.stop)  # before the strings are copied out of the message
            check_logit_bias_count(len(request.sampling.logit_bias))
            params = sampling_from_proto(request.sampling, request.stop, self.frontend.sampling_defaults)
            self.frontend.check_sampling(params)
            prompt_ids, output = await self._prompt(request, params)
            self.frontend.check(prompt_ids, params)
        except (ValueError, RequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            nonce, abort_token = self.abort_tokens.issue(rid)  # the token goes in the first response only
            async with contextlib.aclosing(self.mesh.generate(rid, prompt_ids, params, nonce)) as deltas:
                async for delta in deltas:
                    response = router_pb2.GenerateResponse(request_id=rid, delta=delta, abort_token=abort_token)
                    if output is not None:  # a chat: its reply read as REST's stream reads it
                        response.chat.CopyFrom(_chat_delta(output.take(delta.text, delta.finished)))
                        stopped = delta.finished and delta.finish_reason == common_pb2.FINISH_REASON_STOP
                        if stopped and output.finish_reason("stop") == "tool_calls":  # REST's rule
                            response.delta.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
                    yield response
                    abort_token = b""
        except MeshError as e:
            log.warning("request failed", code=e.code.name, error=e.message)
            await context.abort(e.code, e.message)
        except Exception:  # a bug: the details go to the log, never to the client; never a call left open
            log.exception("request failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        if (problem := request_id_problem(request.request_id)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        nonce = self.abort_tokens.nonce(request.request_id, request.abort_token)
        if nonce is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "a request is aborted with the abort token of its first response (or by cancelling its Generate call)",
            )
        assert nonce is not None  # (context.abort raised)
        # found only while the run that issued the token runs: a token of an earlier request with this id aborts none
        return common_pb2.AbortResponse(found=self.mesh.abort(request.request_id, nonce))

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        f = self.frontend
        return router_pb2.ListModelsResponse(
            models=[
                router_pb2.Model(
                    id=f.model_id, max_model_len=f.max_model_len, vocab_size=f.vocab_size, root=f.model_path
                )
            ]
        )

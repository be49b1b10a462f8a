"""The router's gRPC front door."""

from __future__ import annotations

import uuid

import grpc
import structlog

from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from engine import RequestError
from services.common.convert import sampling_from_proto
from services.common.logs import bind_request, request_id_from
from services.router.frontend import Frontend
from services.router.mesh import Mesh, MeshError
from services.router.registry import WorkerRegistry

log = structlog.get_logger("deltamesh.router")


def new_request_id() -> str:
    return uuid.uuid4().hex


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, mesh: Mesh, registry: WorkerRegistry):
        self.frontend, self.mesh, self.registry = frontend, mesh, registry

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
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model[:200]!r} is not served here "
                                                           f"(serving {self.frontend.model_id!r})")  # fmt: skip
        try:
            params = sampling_from_proto(request.sampling, request.stop)
            params.validate(self.frontend.vocab_size)  # before the prompt: it is cheap and may refuse at once
            prompt_ids = await self._prompt_ids(request)
            self.frontend.check(prompt_ids, params)
        except (ValueError, RequestError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for delta in self.mesh.generate(rid, prompt_ids, params):
                yield router_pb2.GenerateResponse(request_id=rid, delta=delta)
        except MeshError as e:
            log.warning("request failed", code=e.code.name, error=e.message)
            await context.abort(e.code, e.message)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=self.mesh.abort(request.request_id))

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        f = self.frontend
        return router_pb2.ListModelsResponse(
            models=[router_pb2.Model(id=f.model_id, max_model_len=f.max_model_len, vocab_size=f.vocab_size)]
        )

    async def GetLoads(self, request, context) -> common_pb2.GetLoadsResponse:
        return common_pb2.GetLoadsResponse(workers=self.registry.loads())

    async def RegisterWorker(self, request: router_pb2.RegisterWorkerRequest, context):
        try:
            worker = self.registry.add(request.address, request.role, static=False, compat_hash=request.compat_hash)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.model and request.model != self.frontend.model_id:
            log.warning("worker serves another model", address=request.address, model=request.model)
        worker.side_channel = request.side_channel if request.HasField("side_channel") else None
        reply = router_pb2.RegisterWorkerResponse(heartbeat_interval_ms=int(self.registry.heartbeat_interval_s * 1000))
        if request.role == "decode":
            reply.prefill_peers.extend(w.side_channel for w in self.registry.healthy("prefill") if w.side_channel is not None)
        return reply

"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, answered whole or
streamed."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.frontend import Frontend
from deltamesh.services.router.gateway.choices import (
    Choice,
    build_choices,
    check_model,
    check_sampling,
    check_sizes,
)
from deltamesh.services.router.gateway.dependencies import GatewayDep
from deltamesh.services.router.gateway.errors import ApiError, as_api_error
from deltamesh.services.router.gateway.generation import Accumulator
from deltamesh.services.router.gateway.reply import Reply, respond
from deltamesh.services.router.gateway.streaming import Deltas, sse, sse_responses
from deltamesh.v1 import common_pb2

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=oa.ChatCompletion, responses=sse_responses("Chat completion or SSE stream")
)
async def chat_completions(request: Request, body: oa.ChatCompletionRequest, gateway: GatewayDep) -> Response:
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    choices = await chat_choices(gateway.frontend, rid, body)
    return await respond(request, Reply(gateway, body, rid, choices), _chunks, _chat_completion)


async def chat_choices(frontend: Frontend, rid: str, body: oa.ChatCompletionRequest) -> list[Choice]:
    check_model(frontend, body)
    if body.tools:
        raise ApiError(400, "tools are not supported", param="tools")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    check_sampling(frontend, body, max_tokens, logprobs)
    with as_api_error("messages"):
        check_sizes(frontend, 1, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        frontend.check_chat(messages)
        return await frontend.off_loop(_prepare, frontend, rid, body, messages, max_tokens, logprobs)


def _prepare(
    frontend: Frontend,
    rid: str,
    body: oa.ChatCompletionRequest,
    messages: list[dict],
    max_tokens: int | None,
    logprobs: int | None,
) -> list[Choice]:
    return build_choices(frontend, rid, [frontend.encode_chat(messages)], body, max_tokens, logprobs)


def _logprobs(reply: Reply, items: list[common_pb2.TokenLogprob]) -> oa.ChatLogprobs | None:
    if not reply.body.logprobs:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = reply.gateway.token_text(token_id)
        return dict(token=text, logprob=logprob, bytes=list(text.encode()))

    return oa.ChatLogprobs(
        content=[
            oa.ChatTokenLogprob(
                **entry(lp.token_id, lp.logprob),
                top_logprobs=[oa.TopLogprob(**entry(t.token_id, t.logprob)) for t in lp.top],
            )
            for lp in items
        ]
    )


def _chunk(reply: Reply, choices: list[oa.ChatChunkChoice], usage: oa.Usage | None = None) -> str:
    return sse(
        oa.ChatCompletionChunk(id=reply.id, created=reply.created, model=reply.body.model, choices=choices, usage=usage)
    )


async def _chunks(reply: Reply, deltas: Deltas):
    acc = Accumulator(reply.choices)
    for c in reply.choices:  # the role comes first, as OpenAI sends it
        yield _chunk(reply, [oa.ChatChunkChoice(index=c.index, delta=oa.ChatDelta(role="assistant", content=""))])
    async for index, d in deltas:
        acc.add(index, d)
        yield _chunk(
            reply,
            [
                oa.ChatChunkChoice(
                    index=index,
                    delta=oa.ChatDelta(content=d.text),
                    logprobs=_logprobs(reply, list(d.logprobs)),
                    finish_reason=acc.finish[index],
                )
            ],
        )
    if reply.include_usage:
        yield _chunk(reply, [], usage=acc.usage())


def _chat_completion(reply: Reply, acc: Accumulator) -> oa.ChatCompletion:
    return oa.ChatCompletion(
        id=reply.id,
        created=reply.created,
        model=reply.body.model,
        usage=acc.usage(),
        choices=[
            oa.ChatChoice(
                index=c.index,
                message=oa.ChatCompletionMessage(content=acc.text[c.index]),
                finish_reason=acc.finish[c.index],
                logprobs=_logprobs(reply, acc.logprobs[c.index]),
            )
            for c in reply.choices
        ],
    )

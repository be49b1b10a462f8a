"""POST /v1/completions: prompts as text or token ids, answered whole or streamed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import cast

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
    default_max_tokens,
    reply_id,
)
from deltamesh.services.router.gateway.dependencies import GatewayDep
from deltamesh.services.router.gateway.errors import ApiError, as_api_error
from deltamesh.services.router.gateway.generation import Accumulator
from deltamesh.services.router.gateway.reply import Reply, respond
from deltamesh.services.router.gateway.streaming import Deltas, one_line, sse, sse_responses
from deltamesh.v1 import common_pb2

router = APIRouter()


@dataclass
class CompletionReply(Reply):
    body: oa.CompletionRequest


@router.post("/v1/completions", response_model=oa.Completion, responses=sse_responses("Completion or SSE stream"))
async def completions(request: Request, body: oa.CompletionRequest, gateway: GatewayDep) -> Response:
    rid = reply_id("cmpl", body)
    choices = await completion_choices(gateway.frontend, rid, body)
    return await respond(request, CompletionReply(gateway, body, rid, choices), _chunks, _completion)


async def completion_choices(frontend: Frontend, rid: str, body: oa.CompletionRequest) -> list[Choice]:
    check_model(frontend, body)
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise ApiError(400, "best_of must equal n", param="best_of")
    p = body.prompt
    # the prompt's four shapes (pydantic checked each list's items: their first tells which list it is)
    texts: list[str] | None = None
    id_lists: list[list[int]] | None = None
    if isinstance(p, str):
        texts = [p]
    elif p and all(isinstance(x, str) for x in p):
        texts = cast(list[str], p)
    elif p and isinstance(p[0], int):
        id_lists = [p]
    else:
        id_lists = cast(list[list[int]], p) or [[]]
    max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens(frontend)
    check_sampling(frontend, body, max_tokens, body.logprobs)
    with as_api_error("prompt"):
        check_sizes(frontend, len(texts) if texts is not None else len(id_lists or ()), body)
        for text in texts or ():
            frontend.check_text(text)
        for ids in id_lists or ():
            if body.truncate_prompt_tokens is None:  # else truncated first (build_choices)
                frontend.check_token_count(len(ids))
        return await frontend.off_loop(_prepare, frontend, rid, body, texts, id_lists, max_tokens)


def _prepare(
    frontend: Frontend,
    rid: str,
    body: oa.CompletionRequest,
    texts: list[str] | None,
    id_lists: list[list[int]] | None,
    max_tokens: int,
) -> list[Choice]:
    special = body.add_special_tokens is not False  # vLLM's default for a completion: true
    prompts = frontend.encode_texts(texts, special) if texts is not None else id_lists
    assert prompts is not None, "a prompt is texts or token id lists"
    return build_choices(frontend, rid, prompts, body, max_tokens, body.logprobs)


def _logprobs(
    reply: CompletionReply, items: list[common_pb2.TokenLogprob], offset: int
) -> oa.CompletionLogprobs | None:
    if reply.body.logprobs is None:
        return None
    token_text = reply.gateway.token_text
    tokens = [token_text(lp.token_id) for lp in items]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return oa.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob for lp in items],
        text_offset=offsets,
        top_logprobs=[_top(token, lp, token_text) for token, lp in zip(tokens, items)],
    )


def _top(token: str, lp: common_pb2.TokenLogprob, token_text) -> dict[str, float]:
    """As vLLM's: the sampled token first, then the k most likely (it may be one of them); a token whose text
    another's repeats keeps the first's logprob."""
    top = {token: lp.logprob}
    for t in lp.top:
        top.setdefault(token_text(t.token_id), t.logprob)
    return top


class _TextChunks:
    """The SSE event of a chunk that carries only text (most chunks of a stream), written as the schema writes it:
    the event of an empty text is rendered once per choice and the text's JSON put in its place, so that a token
    costs one json.dumps instead of building and dumping two pydantic models (bench/RESULTS.md, "Router CPU per
    streamed token")."""

    def __init__(self, reply: CompletionReply):
        self.reply = reply
        self._around: dict[int, tuple[str, str]] = {}

    def event(self, index: int, text: str) -> str:
        around = self._around.get(index)
        if around is None:
            r = self.reply
            empty = oa.Completion(
                id=r.id, created=r.created, model=r.body.model, choices=[oa.CompletionChoice(index=index, text="")]
            )
            before, after = one_line(empty.model_dump_json(exclude_none=False)).split(
                '"text":""'
            )  # once: JSON escapes quotes
            around = self._around[index] = (f'data: {before}"text":', f"{after}\n\n")
        return around[0] + one_line(json.dumps(text, ensure_ascii=False)) + around[1]


async def _chunks(reply: CompletionReply, deltas: Deltas):
    acc = Accumulator(reply.choices)
    text_only = _TextChunks(reply) if _text_only(reply) else None
    token_ids = reply.body.return_token_ids
    prompts = {c.index: c.prompt_ids for c in reply.choices} if token_ids else {}  # each choice's first chunk's
    async for index, d in deltas:
        offset = len(acc.text[index])
        acc.add(index, d)
        if not d.finished and text_only is not None:
            yield text_only.event(index, d.text)
            continue
        choice = oa.CompletionChoice(
            index=index,
            text=d.text,
            finish_reason=acc.finish[index],
            stop_reason=acc.stop_reason[index],
            logprobs=_logprobs(reply, list(d.logprobs), offset),
            prompt_token_ids=prompts.pop(index, None),
            token_ids=list(d.token_ids) if token_ids else None,
        )
        usage = acc.choice_usage(index) if reply.continuous_usage else None
        yield sse(
            oa.Completion(id=reply.id, created=reply.created, model=reply.body.model, choices=[choice], usage=usage)
        )
    if reply.include_usage:
        yield sse(
            oa.Completion(id=reply.id, created=reply.created, model=reply.body.model, choices=[], usage=acc.usage())
        )


def _text_only(reply: CompletionReply) -> bool:
    """Whether a chunk before a choice's last carries its text alone (the fast path of _TextChunks)."""
    body = reply.body
    return body.logprobs is None and not body.return_token_ids and not reply.continuous_usage


def _completion(reply: CompletionReply, acc: Accumulator) -> oa.Completion:
    token_ids = reply.body.return_token_ids
    return oa.Completion(
        id=reply.id,
        created=reply.created,
        model=reply.body.model,
        usage=acc.usage(),
        choices=[
            oa.CompletionChoice(
                index=c.index,
                text=acc.text[c.index],
                finish_reason=acc.finish[c.index],
                stop_reason=acc.stop_reason[c.index],
                logprobs=_logprobs(reply, acc.logprobs[c.index], 0),
                prompt_token_ids=c.prompt_ids if token_ids else None,
                token_ids=acc.token_ids[c.index] if token_ids else None,
            )
            for c in reply.choices
        ],
    )

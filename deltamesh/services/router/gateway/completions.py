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
from deltamesh.services.router.gateway.prompt_logprobs import (
    Row,
    legacy_logprobs,
    output_rows,
    prompt_rows,
    vllm_prompt_logprobs,
)
from deltamesh.services.router.gateway.reply import Reply, respond
from deltamesh.services.router.gateway.streaming import Deltas, one_line, sse, sse_responses

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
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens")
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        body.prompt_logprobs = body.logprobs  # the echoed prompt's rows (as vLLM)
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
    check_sampling(frontend, body, max(max_tokens, 1), body.logprobs)
    with as_api_error("prompt"):
        check_sizes(frontend, len(texts) if texts is not None else len(id_lists or ()), body)
        for text in texts or ():
            frontend.check_text(text)
        for ids in id_lists or ():
            if body.truncate_prompt_tokens is None:  # else truncated first (build_choices)
                frontend.check_token_count(len(ids))
        if texts is None and not body.echo:
            # token ids only: checking them is a few C passes over what the loop has just parsed, done here so
            # that a burst's requests reach their workers in arrival order, not all after the whole burst's
            # parsing (bench/RESULTS.md, "A burst's arrivals"); tokenising and echo's decoding go off the loop
            return _prepare(frontend, rid, body, texts, id_lists, max_tokens)
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
    choices = build_choices(frontend, rid, prompts, body, max(max_tokens, 1), body.logprobs)
    if body.echo:
        tokenizer = frontend.tokenizer
        for c in choices:
            whole = texts is not None and len(c.prompt_ids) == len(prompts[c.prompt_index])  # (not truncated)
            if whole and texts is not None:
                c.echo = texts[c.prompt_index]
            else:
                c.echo = tokenizer.decode(c.prompt_ids, skip_special_tokens=False) if tokenizer else ""
            c.echo_only = max_tokens == 0
    return choices


def _rows(reply: CompletionReply, c: Choice, text: str, items, prompt_items) -> tuple[str, list[Row]]:
    """A choice's text and logprob rows: the generated ones, after the echoed prompt's where it echoes (its first
    answer only: `prompt_items` is None after it)."""
    rows = output_rows(items)
    if c.echo is None or prompt_items is None:
        return text, rows
    k = reply.body.logprobs
    prompt = prompt_rows(c.prompt_ids, prompt_items, k) if k is not None else []
    return (c.echo, prompt) if c.echo_only else (c.echo + text, prompt + rows)


def _legacy(reply: CompletionReply, rows: list[Row], offset: int) -> oa.CompletionLogprobs | None:
    return legacy_logprobs(rows, offset, reply.gateway.token_text) if reply.body.logprobs is not None else None


def _prompt_logprobs(reply: CompletionReply, items) -> oa.PromptLogprobs | None:
    if reply.body.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(items, reply.gateway.token_text)


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
    first = {c.index: c for c in reply.choices}  # until each choice's first chunk
    sent = dict.fromkeys(first, 0)  # characters of each choice's text sent
    async for index, d in deltas:
        acc.add(index, d)
        c = first.pop(index, None)
        text, rows = _rows(reply, c, d.text, d.logprobs, d.prompt_logprobs) if c else (d.text, output_rows(d.logprobs))
        offset, sent[index] = sent[index], sent[index] + len(text)
        if not d.finished and text_only is not None:
            yield text_only.event(index, text)
            continue
        choice = oa.CompletionChoice(
            index=index,
            text=text,
            finish_reason=acc.finish[index],
            stop_reason=acc.stop_reason[index],
            logprobs=_legacy(reply, rows, offset),
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
    choices = []
    for c in reply.choices:
        prompt_items = acc.prompt_logprobs[c.index]
        text, rows = _rows(reply, c, acc.text[c.index], acc.logprobs[c.index], prompt_items)
        choices.append(
            oa.CompletionChoice(
                index=c.index,
                text=text,
                finish_reason=acc.finish[c.index],
                stop_reason=acc.stop_reason[c.index],
                logprobs=_legacy(reply, rows, 0),
                prompt_token_ids=c.prompt_ids if token_ids else None,
                token_ids=acc.token_ids[c.index] if token_ids else None,
                prompt_logprobs=_prompt_logprobs(reply, prompt_items),
            )
        )
    return oa.Completion(id=reply.id, created=reply.created, model=reply.body.model, usage=acc.usage(), choices=choices)

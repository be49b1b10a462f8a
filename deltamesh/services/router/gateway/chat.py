"""POST /v1/chat/completions: messages (with tools, tool calls and results) rendered with the checkpoint's chat
template, answered whole or streamed; each choice's text split into reasoning, content and tool calls by the
model family's parsers (chat_output/), under the rules the gRPC edge applies too (chat_reply.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.chat_output import ChatOutput, OutputDelta, OutputFormat
from deltamesh.services.router.chat_reply import ChatReplyPlan, plan_chat_reply
from deltamesh.services.router.chat_request import ChatRequest
from deltamesh.services.router.frontend import ChatPrompt, Frontend
from deltamesh.services.router.gateway.choices import (
    Choice,
    build_choices,
    check_model,
    check_sampling,
    check_sizes,
    reply_id,
)
from deltamesh.services.router.gateway.dependencies import GatewayDep
from deltamesh.services.router.gateway.errors import as_api_error
from deltamesh.services.router.gateway.generation import Accumulator
from deltamesh.services.router.gateway.prompt_logprobs import vllm_prompt_logprobs
from deltamesh.services.router.gateway.reply import Reply, respond
from deltamesh.services.router.gateway.streaming import Deltas, sse, sse_responses
from deltamesh.v1 import common_pb2

router = APIRouter()


@dataclass
class ChatReply(Reply):
    body: oa.ChatCompletionRequest
    new_output: Callable[[], ChatOutput] | None = None  # a parser for one choice's text

    def output(self) -> ChatOutput:
        """A new parser for one choice's text."""
        assert self.new_output is not None, "chat_completions gives every reply its parser"
        return self.new_output()


@router.post(
    "/v1/chat/completions", response_model=oa.ChatCompletion, responses=sse_responses("Chat completion or SSE stream")
)
async def chat_completions(request: Request, body: oa.ChatCompletionRequest, gateway: GatewayDep) -> Response:
    rid = reply_id("chatcmpl", body)
    choices, new_output = await chat_choices(gateway.frontend, rid, body, gateway.output_format)
    return await respond(request, ChatReply(gateway, body, rid, choices, new_output=new_output), _chunks, _whole)


def chat_request(body: oa.ChatCompletionRequest) -> ChatRequest:
    return ChatRequest(
        messages=[m.for_template() for m in body.messages],
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice=body.tool_choice_value(),
        parallel_tool_calls=body.parallel_tool_calls,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        # vLLM gives reasoning_effort to the template as a variable; chat_template_kwargs may set it too, and win
        template_kwargs=_effort(body) | (body.chat_template_kwargs or {}),
    )


def _effort(body: oa.ChatCompletionRequest) -> dict:
    return {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort is not None else {}


async def chat_choices(
    frontend: Frontend, rid: str, body: oa.ChatCompletionRequest, fmt: OutputFormat
) -> tuple[list[Choice], Callable[[], ChatOutput]]:
    check_model(frontend, body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    check_sampling(frontend, body, max_tokens, logprobs)
    chat = chat_request(body)
    with as_api_error("messages"):
        check_sizes(frontend, 1, body)
        frontend.check_chat(chat)
        plan = plan_chat_reply(chat, fmt, body.structured is not None)
        prompt, choices = await frontend.off_loop(_prepare, frontend, rid, body, chat, plan, max_tokens, logprobs)
    return choices, partial(plan.new_output, prompt.assistant_prefix)


def _prepare(
    frontend: Frontend,
    rid: str,
    body: oa.ChatCompletionRequest,
    chat: ChatRequest,
    plan: ChatReplyPlan,
    max_tokens: int | None,
    logprobs: int | None,
) -> tuple[ChatPrompt, list[Choice]]:
    prompt = frontend.encode_chat(chat, plan.parsed, bool(body.add_special_tokens))
    return prompt, build_choices(frontend, rid, [prompt.ids], body, max_tokens, logprobs, structured=plan.forced)


def _logprobs(reply: ChatReply, items: list[common_pb2.TokenLogprob]) -> oa.ChatLogprobs | None:
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


def _delta(reply: ChatReply, part: OutputDelta) -> oa.ChatDelta:
    calls = [
        oa.DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id else None,
            function=oa.DeltaFunction(name=c.name, arguments=c.arguments or None),
        )
        for c in part.calls
    ]
    reasoning = (part.reasoning or None) if reply.body.include_reasoning else None
    return oa.ChatDelta(
        content=part.content or None, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls or None
    )


def _chunk(
    reply: Reply,
    choices: list[oa.ChatChunkChoice],
    usage: oa.Usage | None = None,
    prompt_token_ids: list[int] | None = None,
) -> str:
    return sse(
        oa.ChatCompletionChunk(
            id=reply.id,
            created=reply.created,
            model=reply.body.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )
    )


async def _chunks(reply: ChatReply, deltas: Deltas):
    acc = Accumulator(reply.choices)
    outputs = {c.index: reply.output() for c in reply.choices}
    token_ids = reply.body.return_token_ids
    prompt_ids = reply.choices[0].prompt_ids if token_ids else None  # in the first chunk (every choice's prompt)

    def usage(index: int) -> oa.Usage | None:
        return acc.choice_usage(index) if reply.continuous_usage else None

    for c in reply.choices:  # the role comes first, as OpenAI sends it
        role = oa.ChatChunkChoice(index=c.index, delta=oa.ChatDelta(role="assistant", content=""))
        yield _chunk(reply, [role], usage(c.index), prompt_ids)
        prompt_ids = None
    async for index, d in deltas:
        acc.add(index, d)
        output = outputs[index]
        part = output.take(d.text, d.finished)
        delta, logprobs = _delta(reply, part), _logprobs(reply, list(d.logprobs))
        finish = output.finish_reason(acc.finish[index])
        if delta.model_dump() or logprobs is not None or finish is not None or (token_ids and d.token_ids):
            choice = oa.ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=acc.stop_reason[index],
                token_ids=list(d.token_ids) if token_ids else None,
            )
            yield _chunk(reply, [choice], usage(index))
    if reply.include_usage:
        yield _chunk(reply, [], usage=acc.usage())


def _message(reply: ChatReply, output: ChatOutput) -> oa.ChatCompletionMessage:
    calls = [
        oa.ChatToolCall(id=c.id, function=oa.ToolCallFunction(name=c.name, arguments=c.arguments))
        for c in output.tool_calls
    ]
    reasoning = (output.reasoning or None) if reply.body.include_reasoning else None
    content = output.content or (None if calls or output.reasoning else "")
    return oa.ChatCompletionMessage(
        content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls or None
    )


def _whole(reply: ChatReply, acc: Accumulator) -> oa.ChatCompletion:
    token_ids = reply.body.return_token_ids
    choices = []
    for c in reply.choices:
        output = reply.output()
        output.feed(acc.text[c.index])
        output.finish()
        choices.append(
            oa.ChatChoice(
                index=c.index,
                message=_message(reply, output),
                finish_reason=output.finish_reason(acc.finish[c.index]),
                stop_reason=acc.stop_reason[c.index],
                logprobs=_logprobs(reply, acc.logprobs[c.index]),
                token_ids=acc.token_ids[c.index] if token_ids else None,
            )
        )
    return oa.ChatCompletion(
        id=reply.id,
        created=reply.created,
        model=reply.body.model,
        usage=acc.usage(),
        choices=choices,
        prompt_token_ids=reply.choices[0].prompt_ids if token_ids else None,
        prompt_logprobs=vllm_prompt_logprobs(acc.prompt_logprobs[reply.choices[0].index], reply.gateway.token_text)
        if reply.body.prompt_logprobs is not None
        else None,
    )

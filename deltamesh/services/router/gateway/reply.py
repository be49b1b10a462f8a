"""Answering a request whose choices are ready, the same way for completions and chat: streamed as SSE when
the request asks for it, else collected and sent as one JSON body. The route supplies the two formats."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.choices import Choice
from deltamesh.services.router.gateway.dependencies import Gateway
from deltamesh.services.router.gateway.fanout import Fanout
from deltamesh.services.router.gateway.generation import Accumulator, collect
from deltamesh.services.router.gateway.streaming import Deltas, stream_response


@dataclass
class Reply:
    """What every part of one answer shares: its id, creation time, request and choices."""

    gateway: Gateway
    body: oa._Sampling
    id: str
    choices: list[Choice]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk only when asked to, as OpenAI's does."""
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries its choice's usage so far (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.body.stream_options and self.body.stream_options.continuous_usage_stats)


ReplyT = TypeVar("ReplyT", bound=Reply)


async def respond(
    request: Request,
    reply: ReplyT,
    chunks: Callable[[ReplyT, Deltas], AsyncIterator[str]],
    whole: Callable[[ReplyT, Accumulator], BaseModel],
) -> Response:
    limits, mesh = reply.gateway.frontend.limits, reply.gateway.mesh
    fanout = Fanout(limits.max_running_choices, limits.max_prefilling_tokens)
    if reply.body.stream:
        return await stream_response(mesh, reply.choices, fanout, lambda deltas: chunks(reply, deltas))
    acc = await collect(request, mesh, reply.choices, fanout)
    return JSONResponse(whole(reply, acc).model_dump())

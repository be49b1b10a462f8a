"""Server-sent events: an answer streamed as `data: <json>` lines that end with `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.choices import Choice
from deltamesh.services.router.gateway.errors import ApiError
from deltamesh.services.router.gateway.fanout import Fanout
from deltamesh.services.router.gateway.generation import run_choices
from deltamesh.services.router.mesh import Mesh
from deltamesh.v1 import common_pb2

Deltas = AsyncIterator[tuple[int, common_pb2.TokenDelta]]


def sse(obj) -> str:
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def sse_responses(description: str) -> dict:
    """The OpenAPI `responses` of a route that answers JSON or, with `stream: true`, an SSE stream."""
    return {200: {"content": {"text/event-stream": {}}, "description": description}}


async def stream_response(
    mesh: Mesh, choices: list[Choice], fanout: Fanout, chunks: Callable[[Deltas], AsyncIterator[str]]
) -> Response:
    """SSE response of `chunks(deltas)` (the choices started as `fanout` lets them); waits for the first delta so
    that an early failure is a proper HTTP error. A failure once the stream has begun is sent as an error event
    before [DONE]."""
    deltas = run_choices(mesh, choices, fanout)
    try:
        first = await deltas.__anext__()
    except StopAsyncIteration:
        first = None

    async def replay():
        if first is not None:
            yield first
        async for item in deltas:
            yield item

    async def body():
        try:
            async for text in chunks(replay()):
                yield text
        except ApiError as e:
            yield sse(oa.ErrorResponse(error=e.detail))
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )

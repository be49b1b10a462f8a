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


# Characters JSON leaves raw in a string but str.splitlines() takes for line ends, and with it the line readers of
# httpx (`aiter_lines`) and requests (`iter_lines`): raw in an event's data line they cut the event in two and the
# client fails on half a JSON object (a random-weight model's json_schema output did, through httpx). Their JSON
# escapes decode to the same text; they can only stand inside JSON strings, so replacing them anywhere is safe.
_LINE_ENDS_JSON_LEAVES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(json_text: str) -> str:
    """`json_text` with every character that a line reader could split on escaped (ASCII text as it is)."""
    return json_text if json_text.isascii() else json_text.translate(_LINE_ENDS_JSON_LEAVES)


def sse(obj) -> str:
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {one_line(data)}\n\n"


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

"""Running a request's choices in the mesh: their deltas merged into one stream, and, for an answer sent
whole, accumulated per choice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import structlog
from fastapi import Request

from deltamesh.services.router import openai_schema as oa
from deltamesh.services.router.gateway.choices import Choice
from deltamesh.services.router.gateway.errors import ApiError
from deltamesh.services.router.gateway.fanout import Fanout
from deltamesh.services.router.mesh import Mesh, MeshError
from deltamesh.v1 import common_pb2

log = structlog.get_logger("deltamesh.gateway")

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


async def _produce(mesh: Mesh, choice: Choice, out: asyncio.Queue, fanout: Fanout) -> None:
    """Runs a choice that `fanout` let start, and counts it out of `fanout` as it gets its first token and ends."""
    prefilling = True  # until its first token
    try:
        deltas = mesh.generate(choice.request_id, choice.prompt_ids, choice.params)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                if prefilling:
                    fanout.prefilled(len(choice.prompt_ids))
                    prefilling = False
                await out.put((choice.index, delta))
    except MeshError as e:
        await out.put((choice.index, ApiError.from_mesh(e)))
    except Exception:  # a bug: report it as a 500, never hang the stream (details go to the log only)
        log.exception("choice failed", request_id=choice.request_id)
        await out.put((choice.index, ApiError(500, "internal error", "server_error")))
    finally:
        if prefilling:
            fanout.prefilled(len(choice.prompt_ids))
        fanout.ended()
        await out.put((choice.index, None))


def _merged(items: list, queue: asyncio.Queue) -> list:
    """`items` and all else waiting in `queue`, each choice's consecutive deltas merged into one: a stream that
    fell behind (a slow client, a busy loop) sends what piled up as one event, not a growing backlog."""
    while not queue.empty():
        items.append(queue.get_nowait())
    out: list = []
    open_delta: dict[int, common_pb2.TokenDelta] = {}  # choice -> its delta in `out` that later ones still merge into
    for index, item in items:
        if isinstance(item, common_pb2.TokenDelta) and index in open_delta:
            merge_delta(open_delta[index], item)
            continue
        out.append((index, item))
        if isinstance(item, common_pb2.TokenDelta):
            open_delta[index] = item
        else:
            open_delta.pop(index, None)
    return out


def merge_delta(delta: common_pb2.TokenDelta, later: common_pb2.TokenDelta) -> None:
    """`later` (the same choice's next delta) appended to `delta`: tokens, text and logprobs added, the rest
    (finish, stop reason, running usage) taken from `later`."""
    text = delta.text + later.text
    delta.MergeFrom(later)  # repeated fields append; set scalars, the usage and the stop reason overwrite
    delta.text = text


async def run_choices(
    mesh: Mesh, choices: list[Choice], fanout: Fanout
) -> AsyncGenerator[tuple[int, common_pb2.TokenDelta], None]:
    """Deltas of all choices as they arrive; raises ApiError on the first failure. Leaving early
    (client gone) cancels every choice in the mesh. The choices start in order, as `fanout` lets them (fanout.py:
    a request of many prompts must not hold back other clients' requests)."""
    if len(choices) == 1:
        async for item in _run_one(mesh, choices[0], fanout):
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def start_in_turn() -> None:
        for c in choices:
            await fanout.start(len(c.prompt_ids))
            tasks.append(asyncio.create_task(_produce(mesh, c, queue, fanout)))

    tasks.append(asyncio.create_task(start_in_turn()))
    open_choices = len(choices)
    finished: set[int] = set()
    try:
        while open_choices:
            for index, item in _merged([await queue.get()], queue):
                if item is None:
                    open_choices -= 1
                    if index not in finished:  # never end a choice silently
                        raise ApiError(502, "a worker stream ended before the request finished", "server_error")
                elif isinstance(item, ApiError):
                    raise item
                else:
                    if item.finished:
                        finished.add(index)
                    yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_one(
    mesh: Mesh, choice: Choice, fanout: Fanout
) -> AsyncGenerator[tuple[int, common_pb2.TokenDelta], None]:
    """`run_choices` of a request with one choice (most requests): its deltas straight from the mesh, in the task of
    whoever reads them. Without the per-choice task and queue that merge several choices, a token costs one task
    switch instead of two (bench/RESULTS.md, "Router CPU per streamed token")."""
    await fanout.start(len(choice.prompt_ids))
    prefilling, finished = True, False
    try:
        deltas = mesh.generate(choice.request_id, choice.prompt_ids, choice.params)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                if prefilling:
                    fanout.prefilled(len(choice.prompt_ids))
                    prefilling = False
                finished = delta.finished
                yield choice.index, delta
    except MeshError as e:
        raise ApiError.from_mesh(e) from None
    except ApiError:
        raise
    except Exception:  # a bug: report it as a 500 (details go to the log only)
        log.exception("choice failed", request_id=choice.request_id)
        raise ApiError(500, "internal error", "server_error") from None
    finally:
        if prefilling:
            fanout.prefilled(len(choice.prompt_ids))
        fanout.ended()
    if not finished:  # never end a choice silently
        raise ApiError(502, "a worker stream ended before the request finished", "server_error")


def stop_reason(delta: common_pb2.TokenDelta, stop_token_ids: list[int]) -> oa.StopReason:
    """vLLM's stop_reason of a choice's last delta: the stop string, or the token of stop_token_ids, that ended it;
    None for the end-of-sequence token (which the engine reports as its stop token too) and the length."""
    which = delta.WhichOneof("stop_reason")
    if which == "stop_string":
        return delta.stop_string
    if which == "stop_token_id" and delta.stop_token_id in stop_token_ids:
        return delta.stop_token_id
    return None


class Accumulator:
    """Per choice: text, token ids, finish and stop reasons, logprobs, token counts."""

    def __init__(self, choices: list[Choice]):
        self.text = {c.index: "" for c in choices}
        self.token_ids: dict[int, list[int]] = {c.index: [] for c in choices}
        self.finish: dict[int, str | None] = {c.index: None for c in choices}
        self.stop_reason: dict[int, oa.StopReason] = {c.index: None for c in choices}
        self._stop_token_ids = {c.index: c.params.stop_token_ids for c in choices}
        self.logprobs: dict[int, list[common_pb2.TokenLogprob]] = {c.index: [] for c in choices}
        self.prompt_logprobs: dict[int, list[common_pb2.TokenLogprob]] = {c.index: [] for c in choices}
        self.prompt_tokens = {c.prompt_index: len(c.prompt_ids) for c in choices}  # once per prompt, as OpenAI
        self.completion_tokens = {c.index: 0 for c in choices}
        # per prompt, as prompt_tokens: the most any of its choices (each a request of its own) found cached
        self.cached_tokens = {c.prompt_index: 0 for c in choices}
        self.prompt_of = {c.index: c.prompt_index for c in choices}

    def add(self, index: int, delta: common_pb2.TokenDelta) -> None:
        self.text[index] += delta.text
        self.token_ids[index] += delta.token_ids
        self.logprobs[index] += list(delta.logprobs)
        self.prompt_logprobs[index] += list(delta.prompt_logprobs)  # (the first delta's)
        self.completion_tokens[index] = delta.usage.completion_tokens or self.completion_tokens[index]
        prompt = self.prompt_of[index]
        self.cached_tokens[prompt] = max(self.cached_tokens[prompt], delta.usage.cached_tokens)
        if delta.finished:
            self.finish[index] = _FINISH.get(delta.finish_reason)
            self.stop_reason[index] = stop_reason(delta, self._stop_token_ids[index])

    def usage(self) -> oa.Usage:
        """The request's: every prompt once, every choice's completion."""
        p, c = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return _usage(p, c, sum(self.cached_tokens.values()))

    def choice_usage(self, index: int) -> oa.Usage:
        """One choice's so far (its prompt's tokens and its own completion), as vLLM's continuous usage stats."""
        prompt = self.prompt_of[index]
        return _usage(self.prompt_tokens[prompt], self.completion_tokens[index], self.cached_tokens[prompt])


def _usage(prompt: int, completion: int, cached: int) -> oa.Usage:
    details = oa.PromptTokensDetails(cached_tokens=cached)
    return oa.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


async def collect(request: Request, mesh: Mesh, choices: list[Choice], fanout: Fanout) -> Accumulator:
    """All choices run to the end (started as `fanout` lets them); a client that hangs up aborts its request in
    the mesh (499)."""
    acc = Accumulator(choices)

    async def consume():
        async for index, delta in run_choices(mesh, choices, fanout):
            acc.add(index, delta)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ApiError(499, "client disconnected", "cancelled")
    task.result()
    return acc

"""The OpenAI-compatible REST gateway (FastAPI on uvicorn), served by the router process on the same event
loop as its gRPC front door and calling the same `Mesh`.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent events
ending in `data: [DONE]`), GET /v1/models, GET /health (liveness), GET /ready (readiness: are there workers
to serve), GET /metrics (Prometheus). Errors use OpenAI's JSON error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import h11
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from deltamesh.v1 import common_pb2
from engine import RequestError, SamplingParams
from engine.sampling import MAX_STOP_STRINGS
from services.router import openai_schema as oa
from services.common.settings import RequestLimits
from services.router.frontend import Frontend
from services.router.mesh import Mesh, MeshError

log = structlog.get_logger("deltamesh.gateway")
MAX_BODY_BYTES = 4 << 20

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}  # fmt: skip
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
ERROR_RESPONSES = {code: {"model": oa.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 502, 503)}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.detail = status, oa.ErrorDetail(message=message, type=type_, param=param, code=code)

    @classmethod
    def from_mesh(cls, e: MeshError) -> "ApiError":
        status, kind = _HTTP_STATUS.get(e.code, (500, "server_error"))
        return cls(status, e.message, kind)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None  # nothing to serve with yet: come back soon
        return _AsciiJSON(oa.ErrorResponse(error=self.detail).model_dump(), status_code=self.status, headers=headers)


class _AsciiJSON(JSONResponse):
    """Error bodies escape non-ASCII: a message that quotes the client's input (a lone surrogate, say) can
    always be encoded."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


@dataclass
class Choice:
    """One generation of a request (a prompt x one of n)."""

    index: int
    prompt_index: int  # which prompt of the request (n choices share one)
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@contextlib.contextmanager
def _as_api_error(param: str):
    """A request the frontend or the engine refuses is the client's error: 400 naming the parameter."""
    try:
        yield
    except RequestError as e:
        code = "context_length_exceeded" if "context length" in str(e) else None
        raise ApiError(400, str(e), param=param, code=code) from None


def _now() -> int:
    return int(time.time())


class Gateway:
    def __init__(self, frontend: Frontend, mesh: Mesh, api_key: str | None = None):
        self.frontend, self.mesh, self.api_key = frontend, mesh, api_key

    # ---- request -> choices ------------------------------------------------------------------------
    # Cheap checks (model, unsupported fields, counts and sizes) run on the event loop and come first; the
    # work that grows with the input (tokenising, templating, scanning token ids) runs as one job per
    # request in the frontend's thread pool, so that no request can stall the other streams.
    def _check_model(self, model: str) -> None:
        if model != self.frontend.model_id:
            raise ApiError(404, f"The model {model[:200]!r} does not exist (this server serves "
                                f"{self.frontend.model_id!r})", param="model", code="model_not_found")  # fmt: skip

    @staticmethod
    def _reject_unsupported(body: oa._Sampling) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported (only 0)", param=name)
        if body.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")

    def _params(self, body: oa._Sampling, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=None if body.seed is None else (body.seed + choice) % 2**64,  # n choices must differ
            stop=body.stop_list(),
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )

    def _choices(self, rid: str, prompts: list[list[int]], body: oa._Sampling, max_tokens, logprobs) -> list[Choice]:
        """Each prompt is checked once (its n choices differ only in their seed)."""
        choices = []
        for p, prompt_ids in enumerate(prompts):
            mt = max_tokens if max_tokens is not None else self.frontend.max_model_len - len(prompt_ids)
            for j in range(body.n):
                params = self._params(body, max(mt, 1), logprobs, j)
                if j == 0:
                    self.frontend.check(prompt_ids, params)
                index = p * body.n + j
                choices.append(Choice(index, p, f"{rid}-{index}", prompt_ids, params))
        return choices

    def _check_sizes(self, prompt_count: int, body: oa._Sampling) -> None:
        f = self.frontend
        f.check_count(prompt_count, f.limits.max_prompts, "prompts")
        f.check_count(prompt_count * body.n, f.limits.max_choices, "choices (prompts x n)")
        f.check_count(len(body.stop_list()), MAX_STOP_STRINGS, "stop strings")
        for text in body.stop_list():
            f.check_text(text, "a stop string")

    async def completion_choices(self, rid: str, body: oa.CompletionRequest) -> list[Choice]:
        self._check_model(body.model)
        self._reject_unsupported(body)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise ApiError(400, "best_of must equal n", param="best_of")
        p = body.prompt
        texts = [p] if isinstance(p, str) else p if p and all(isinstance(x, str) for x in p) else None
        id_lists = None if texts is not None else [p] if p and isinstance(p[0], int) else p or [[]]
        f = self.frontend
        with _as_api_error("prompt"):
            self._check_sizes(len(texts if texts is not None else id_lists), body)
            for text in texts or ():
                f.check_text(text)
            for ids in id_lists or ():
                f.check_token_count(len(ids))

            def prepare() -> list[Choice]:
                prompts = f.encode_texts(texts) if texts is not None else id_lists
                return self._choices(rid, prompts, body, body.max_tokens, body.logprobs)

            return await f.off_loop(prepare)

    async def chat_choices(self, rid: str, body: oa.ChatCompletionRequest) -> list[Choice]:
        self._check_model(body.model)
        self._reject_unsupported(body)
        if body.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if body.response_format and body.response_format.get("type") != "text":
            raise ApiError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        f = self.frontend
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        with _as_api_error("messages"):
            self._check_sizes(1, body)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            f.check_chat(messages)

            def prepare() -> list[Choice]:
                return self._choices(rid, [f.encode_chat(messages)], body, max_tokens, logprobs)

            return await f.off_loop(prepare)

    # ---- running choices ----------------------------------------------------------------------------
    async def _produce(self, choice: Choice, out: asyncio.Queue) -> None:
        try:
            deltas = self.mesh.generate(choice.request_id, choice.prompt_ids, choice.params)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    await out.put((choice.index, delta))
        except MeshError as e:
            await out.put((choice.index, ApiError.from_mesh(e)))
        except Exception:  # a bug: report it as a 500, never hang the stream (details go to the log only)
            log.exception("choice failed", request_id=choice.request_id)
            await out.put((choice.index, ApiError(500, "internal error", "server_error")))
        finally:
            await out.put((choice.index, None))

    async def run(self, choices: list[Choice]) -> AsyncIterator[tuple[int, common_pb2.TokenDelta]]:
        """Deltas of all choices as they arrive; raises ApiError on the first failure. Leaving early
        (client gone) cancels every choice in the mesh."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._produce(c, queue)) for c in choices]
        open_choices = len(choices)
        finished: set[int] = set()
        try:
            while open_choices:
                index, item = await queue.get()
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

    def token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id], skip_special_tokens=False) if self.frontend.tokenizer else ""


def _usage(prompt: dict[int, int], completion: dict[int, int]) -> oa.Usage:
    p, c = sum(prompt.values()), sum(completion.values())
    return oa.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _sse(obj) -> str:
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


class _Accumulator:
    """Per choice: text, finish reason, logprobs, token counts."""

    def __init__(self, choices: list[Choice]):
        self.text = {c.index: "" for c in choices}
        self.finish = {c.index: None for c in choices}
        self.logprobs = {c.index: [] for c in choices}
        self.prompt_tokens = {c.prompt_index: len(c.prompt_ids) for c in choices}  # once per prompt, as OpenAI
        self.completion_tokens = {c.index: 0 for c in choices}

    def add(self, index: int, delta: common_pb2.TokenDelta) -> None:
        self.text[index] += delta.text
        self.logprobs[index] += list(delta.logprobs)
        self.completion_tokens[index] = delta.usage.completion_tokens or self.completion_tokens[index]
        if delta.finished:
            self.finish[index] = _FINISH.get(delta.finish_reason)

    def usage(self) -> oa.Usage:
        return _usage(self.prompt_tokens, self.completion_tokens)


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="deltamesh", version="0.1.0", summary="OpenAI-compatible API of a deltamesh router",
                  responses=ERROR_RESPONSES)  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        return ApiError(413, f"request body over {MAX_BODY_BYTES} bytes").response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            return ApiError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}").response()
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if not loc and "json" not in request.headers.get("content-type", ""):  # FastAPI read it as a plain string
            return ApiError(400, "the request body must be a JSON object sent with 'Content-Type: application/json'"
                            ).response()  # fmt: skip
        message = err.get("msg", "invalid request")
        return ApiError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}", param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if isinstance(e.__cause__, BodyTooLarge):  # FastAPI wraps errors raised while reading the body
            return await _too_large(request, e.__cause__)
        return ApiError(e.status_code, str(e.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):  # details go to the log, never to the client
        log.exception("request failed", path=request.url.path)
        return ApiError(500, "internal error", "server_error").response()

    app.add_middleware(LimitsAndAuth, api_key=gateway.api_key, limits=gateway.frontend.limits)

    @app.get("/health", summary="Liveness")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: healthy workers to serve requests",
             responses={503: {"model": oa.ErrorResponse}})  # fmt: skip
    async def ready():
        if not gateway.mesh.ready():
            return ApiError(503, "no healthy workers to serve requests", "service_unavailable").response()
        healthy = [w.role for w in gateway.mesh.registry.workers.values() if w.healthy]
        return {"status": "ready", "workers": {role: healthy.count(role) for role in sorted(set(healthy))}}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=oa.ModelList)
    async def models() -> oa.ModelList:
        f = gateway.frontend
        return oa.ModelList(data=[oa.ModelCard(id=f.model_id, created=0, max_model_len=f.max_model_len)])

    async def _collect(request: Request, choices: list[Choice]) -> _Accumulator:
        acc = _Accumulator(choices)

        async def consume():
            async for index, delta in gateway.run(choices):
                acc.add(index, delta)

        task = asyncio.create_task(consume())
        while not task.done():  # a client that hangs up aborts its request in the mesh
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client disconnected", "cancelled")
        task.result()
        return acc

    async def _stream(request: Request, choices: list[Choice], chunks) -> Response:
        """SSE response; waits for the first delta so that an early failure is a proper HTTP error."""
        deltas = gateway.run(choices)
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
                yield _sse(oa.ErrorResponse(error=e.detail))
            finally:
                await deltas.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip

    @app.post("/v1/completions", response_model=oa.Completion,
              responses={200: {"content": {"text/event-stream": {}}, "description": "Completion or SSE stream"}})  # fmt: skip
    async def completions(request: Request, body: oa.CompletionRequest) -> Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = await gateway.completion_choices(rid, body)
        created = _now()

        def logprobs_of(items: list[common_pb2.TokenLogprob], offset: int) -> oa.CompletionLogprobs | None:
            if body.logprobs is None:
                return None
            tokens = [gateway.token_text(lp.token_id) for lp in items]
            offsets, pos = [], offset
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            return oa.CompletionLogprobs(
                tokens=tokens, token_logprobs=[lp.logprob for lp in items], text_offset=offsets,
                top_logprobs=[{gateway.token_text(t.token_id): t.logprob for t in lp.top} for lp in items],
            )  # fmt: skip

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def chunks(deltas):
                acc = _Accumulator(choices)
                async for index, d in deltas:
                    offset = len(acc.text[index])
                    acc.add(index, d)
                    choice = oa.CompletionChoice(index=index, text=d.text, finish_reason=acc.finish[index],
                                                 logprobs=logprobs_of(list(d.logprobs), offset))  # fmt: skip
                    yield _sse(oa.Completion(id=rid, created=created, model=body.model, choices=[choice]))
                if include_usage:
                    yield _sse(oa.Completion(id=rid, created=created, model=body.model, choices=[], usage=acc.usage()))

            return await _stream(request, choices, chunks)

        acc = await _collect(request, choices)
        return JSONResponse(oa.Completion(
            id=rid, created=created, model=body.model, usage=acc.usage(),
            choices=[oa.CompletionChoice(index=c.index, text=acc.text[c.index], finish_reason=acc.finish[c.index],
                                         logprobs=logprobs_of(acc.logprobs[c.index], 0)) for c in choices],
        ).model_dump())  # fmt: skip

    @app.post("/v1/chat/completions", response_model=oa.ChatCompletion,
              responses={200: {"content": {"text/event-stream": {}}, "description": "Chat completion or SSE stream"}})  # fmt: skip
    async def chat_completions(request: Request, body: oa.ChatCompletionRequest) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await gateway.chat_choices(rid, body)
        created = _now()

        def logprobs_of(items: list[common_pb2.TokenLogprob]) -> oa.ChatLogprobs | None:
            if not body.logprobs:
                return None

            def entry(token_id: int, logprob: float) -> dict:
                text = gateway.token_text(token_id)
                return dict(token=text, logprob=logprob, bytes=list(text.encode()))

            return oa.ChatLogprobs(content=[
                oa.ChatTokenLogprob(**entry(lp.token_id, lp.logprob),
                                    top_logprobs=[oa.TopLogprob(**entry(t.token_id, t.logprob)) for t in lp.top])
                for lp in items
            ])  # fmt: skip

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(choice_list, usage=None) -> str:
                return _sse(oa.ChatCompletionChunk(id=rid, created=created, model=body.model, choices=choice_list,
                                                   usage=usage))  # fmt: skip

            async def chunks(deltas):
                acc = _Accumulator(choices)
                for c in choices:  # the role comes first, as OpenAI sends it
                    yield chunk([oa.ChatChunkChoice(index=c.index, delta=oa.ChatDelta(role="assistant", content=""))])
                async for index, d in deltas:
                    acc.add(index, d)
                    yield chunk([oa.ChatChunkChoice(index=index, delta=oa.ChatDelta(content=d.text),
                                                    logprobs=logprobs_of(list(d.logprobs)),
                                                    finish_reason=acc.finish[index])])  # fmt: skip
                if include_usage:
                    yield chunk([], usage=acc.usage())

            return await _stream(request, choices, chunks)

        acc = await _collect(request, choices)
        return JSONResponse(oa.ChatCompletion(
            id=rid, created=created, model=body.model, usage=acc.usage(),
            choices=[oa.ChatChoice(index=c.index, message=oa.ChatCompletionMessage(content=acc.text[c.index]),
                                   finish_reason=acc.finish[c.index], logprobs=logprobs_of(acc.logprobs[c.index]))
                     for c in choices],
        ).model_dump())  # fmt: skip

    return app


class LimitsAndAuth:
    """API key, body-size and request-size checks on /v1 routes. Plain ASGI (not BaseHTTPMiddleware) so that
    handlers still see the client's disconnect, which aborts its request in the mesh."""

    def __init__(self, app, api_key: str | None, limits: RequestLimits):
        self.app, self.api_key, self.limits = app, api_key, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            oa.LIMITS.set(self.limits)  # for the request schema's counts
            headers = dict(scope["headers"])
            length = headers.get(b"content-length", b"").strip()
            error = None
            if self.api_key and headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
                error = ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                                 code="invalid_api_key")  # fmt: skip
            elif length.isdigit() and int(length) > MAX_BODY_BYTES:
                error = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
            if error is not None:
                return await error.response()(scope, receive, send)
            return await self.app(scope, _capped(receive), send)
        return await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


def _capped(receive):
    """A receive that stops a body without Content-Length (chunked) once it passes the limit."""
    received = 0

    async def capped():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise BodyTooLarge()
        return message

    return capped


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the router process, which owns signal handling."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving a request's line and headers. uvicorn closes idle
    keep-alive connections but has no such deadline: a client that connects and sends nothing, or half a
    request line, would hold its connection (and a file descriptor) for ever. The deadline starts when the
    connection opens or a new request's first bytes arrive, and ends with the request's head."""

    header_timeout_s = 10.0  # set per server by start_gateway

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # (re)start: these bytes begin a request
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's head is in
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


async def start_gateway(gateway: Gateway, host: str, port: int,
                        header_timeout_s: float = 10.0) -> tuple[_EmbeddedServer, asyncio.Task]:  # fmt: skip
    protocol = type("HeaderDeadline", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(create_app(gateway), host=host, port=port, log_config=None, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=2, http=protocol)  # fmt: skip
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # re-raise a bind failure
        raise OSError(f"REST gateway could not start on {host}:{port}")
    return server, task

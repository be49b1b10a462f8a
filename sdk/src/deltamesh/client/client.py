"""Sync and asyncio clients for the deltamesh router.

Both clients are one `_ClientBase` (channel, credentials, API key, the requests they send, when a failed call is
tried again) with thin I/O on top: `Client` blocks, `AsyncClient` awaits. Only the loops that wait differ."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar, cast

import grpc

from deltamesh.client.chat import chat_messages
from deltamesh.client.errors import DeltameshError, InvalidRequest, Unavailable, from_rpc_error
from deltamesh.client.structured import structured_message
from deltamesh.client.types import Delta, Model, Result
from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc

Prompt = str | Sequence[int] | Sequence[dict]

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)]
_UNARY_TIMEOUT_S = 5  # Abort and ListModels: quick calls that never wait on a model


def build_request(
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    ignore_eos: bool | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    include_stop_str_in_output: bool | None = None,
    skip_special_tokens: bool | None = None,
    model: str = "",
    request_id: str | None = None,
    response_format: dict | None = None,
    structured_outputs: dict | None = None,
    tools: Sequence[dict] = (),
    tool_choice: str | dict | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> router_pb2.GenerateRequest:
    """A prompt is text, token ids, or chat messages in OpenAI's shape ({"role": ..., "content": ...}, an
    assistant's "tool_calls", a tool result's "tool_call_id", "reasoning_content"). A chat takes `tools` (OpenAI's
    function tools), `tool_choice` ("none", "auto", "required" or {"type": "function", "function": {"name": ...}};
    left None: auto with tools, none without), `parallel_tool_calls` (False: one call at most),
    `chat_template_kwargs` (e.g. {"enable_thinking": False}), `add_generation_prompt` and `continue_final_message`
    (chat.py); its reply comes back read into reasoning, content and tool calls (Result, Delta.chat). A sampling keyword left None takes the server's default (the checkpoint's
    recommended value, from its generation_config.json, else the router's SamplingParams). Values the protocol cannot carry (negative counts, ids over 32 bits) raise InvalidRequest
    before anything is sent.

    Structured outputs, as the REST API takes them: `response_format` in OpenAI's shape ({"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}) or `structured_outputs` in vLLM's
    ({"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": EBNF}, {"json_object": True}, and
    "disable_any_whitespace")."""
    sampling: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1 is off, as 0 is
        min_p=min_p,
        seed=seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=ignore_eos,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        skip_special_tokens=skip_special_tokens,
    )
    stops: dict[str, Any] = dict(
        stop=list(stop), stop_token_ids=list(stop_token_ids), include_stop_str_in_output=include_stop_str_in_output
    )
    chat: dict[str, Any] = dict(
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    try:
        req = router_pb2.GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            model=model,
            sampling=common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
            stop=common_pb2.StopConditions(**{k: v for k, v in stops.items() if v is not None}),
        )
        structured = structured_message(structured_outputs, response_format)
        if structured is not None:
            req.sampling.structured_outputs.CopyFrom(structured)
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            req.chat.CopyFrom(chat_messages(cast(Sequence[dict], prompt), **chat))  # (its first item is a message)
        else:
            req.token_ids.ids.extend(prompt)
        chat_only = (tools, tool_choice is not None, parallel_tool_calls is not None, chat_template_kwargs)
        if not req.HasField("chat") and (any(chat_only) or not add_generation_prompt or continue_final_message):
            raise ValueError("tools and the chat template's options apply to chat messages only")
        return req
    except (ValueError, TypeError) as e:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {e}") from None


_KEYWORDS = [name for name in inspect.signature(build_request).parameters if name != "prompt"]


def _request(prompt: Prompt, kwargs: dict) -> router_pb2.GenerateRequest:
    """build_request for the clients' generate and stream, whose `**kwargs` are its keywords: an unknown one is
    named with the list of those taken."""
    unknown = sorted(set(kwargs) - set(_KEYWORDS))
    if unknown:
        raise TypeError(
            f"unknown keyword argument(s) {', '.join(unknown)}; generate and stream take the prompt, "
            f"timeout and {', '.join(_KEYWORDS)} (see build_request)"
        )
    return build_request(prompt, **kwargs)


class _StreamBase:
    """One Generate call: the deltas it has delivered, the abort token of its first response, cancelling it."""

    def __init__(self, client: _ClientBase, request: router_pb2.GenerateRequest, timeout: float | None):
        self.client, self.request_id = client, request.request_id
        self._stop_token_ids = frozenset(request.stop.stop_token_ids)
        self._call = client._stub.Generate(request, timeout=timeout, metadata=client._metadata)
        self._done = False
        self.abort_token = b""

    def _delta(self, msg: router_pb2.GenerateResponse) -> Delta:
        self.abort_token = msg.abort_token or self.abort_token
        chat = msg.chat if msg.HasField("chat") else None
        delta = Delta.from_proto(self.request_id, msg.delta, chat, self._stop_token_ids)
        self._done = delta.finished
        return delta

    def _cancel(self) -> None:
        """Cancelling the call aborts the request in the mesh."""
        if not self._done:
            self._done = True
            self._call.cancel()


class Stream(_StreamBase):
    """Iterator of `Delta`s; `cancel()` (or leaving a `with` block early) aborts the request. `abort_token`
    (set once the first delta arrived) lets `Client.abort` stop the request from elsewhere."""

    def __iter__(self) -> Iterator[Delta]:
        try:
            for msg in self._call:
                yield self._delta(msg)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def cancel(self) -> None:
        """Cancelling the call aborts the request in the mesh."""
        self._cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class AsyncStream(_StreamBase):
    """Async iterator of `Delta`s, as `Stream`."""

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self._call:
                yield self._delta(msg)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def cancel(self) -> None:
        """Cancelling the call aborts the request in the mesh."""
        self._cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.cancel()


class _ClientBase:
    """What both clients share. `_channels` is the module that opens their channel (grpc or grpc.aio, whose
    secure_channel and insecure_channel take the same arguments), `_stream_type` the stream they return."""

    _channels: ClassVar = grpc
    _stream_type: ClassVar[type[_StreamBase]] = _StreamBase

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        timeout: float | None = None,
        retries: int = 2,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        api_key: str | None = None,
    ):
        """`api_key`: the router's API key, if it has one (sent as `authorization: Bearer` metadata)."""
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if root_certificates is None:
            self._channel = self._channels.insecure_channel(address, options=_OPTIONS)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self._channel = self._channels.secure_channel(address, creds, options=_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.timeout, self.retries = timeout, retries

    def _open(self, request: router_pb2.GenerateRequest, timeout: float | None):
        return self._stream_type(self, request, timeout or self.timeout)

    def _backoff(self, attempt: int, error: DeltameshError) -> float | None:
        """Seconds to wait before trying a failed call again, or None to give up: only UNAVAILABLE (the call
        reached no worker) is worth another try, while attempts are left."""
        if not isinstance(error, Unavailable) or attempt >= self.retries:
            return None
        return 0.1 * 2**attempt

    def _abort_call(self, request_id: str, abort_token: bytes):
        request = common_pb2.AbortRequest(request_id=request_id, abort_token=abort_token)
        return lambda: self._stub.Abort(request, timeout=_UNARY_TIMEOUT_S, metadata=self._metadata)

    def _list_models_call(self):
        request = router_pb2.ListModelsRequest()
        return lambda: self._stub.ListModels(request, timeout=_UNARY_TIMEOUT_S, metadata=self._metadata)


class Client(_ClientBase):
    _stream_type = Stream

    def _retry(self, make_call):
        for attempt in itertools.count():
            try:
                return make_call()
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                delay = self._backoff(attempt, err)
                if delay is None:
                    raise err from None
            time.sleep(delay)

    def generate(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> Result:
        """The whole result. `kwargs`: build_request's keywords (max_tokens, temperature, top_p, top_k, min_p, seed,
        stop, stop_token_ids, logprobs, prompt_logprobs, ignore_eos, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias, min_tokens, include_stop_str_in_output, skip_special_tokens, model, request_id,
        response_format, structured_outputs; for a chat, tools, tool_choice, parallel_tool_calls, chat_template_kwargs,
        add_generation_prompt, continue_final_message)."""
        request = _request(prompt, kwargs)
        attempt = 0
        while True:
            result = Result(request.request_id)
            try:
                for delta in self._open(request, timeout):
                    result.add(delta)
                return result
            except Unavailable as e:
                # Safe to retry only if nothing was generated: the request never reached a worker.
                delay = None if result.token_ids else self._backoff(attempt, e)
                if delay is None:
                    raise
            time.sleep(delay)
            attempt += 1

    def stream(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> Stream:
        """The deltas as they come (`kwargs` as for generate)."""
        return self._open(_request(prompt, kwargs), timeout)

    def abort(self, request_id: str, abort_token: bytes) -> bool:
        """Abort a request of this client's from elsewhere, with the `abort_token` of its stream."""
        return self._retry(self._abort_call(request_id, abort_token)).found

    def list_models(self) -> list[Model]:
        return [Model.from_proto(m) for m in self._retry(self._list_models_call()).models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_ClientBase):
    _channels = grpc.aio
    _stream_type = AsyncStream

    async def _retry(self, make_call):
        for attempt in itertools.count():
            try:
                return await make_call()
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                delay = self._backoff(attempt, err)
                if delay is None:
                    raise err from None
            await asyncio.sleep(delay)

    async def generate(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> Result:
        """The whole result (`kwargs` as for Client.generate: build_request's sampling keywords)."""
        request = _request(prompt, kwargs)
        attempt = 0
        while True:
            result = Result(request.request_id)
            try:
                async for delta in self._open(request, timeout):
                    result.add(delta)
                return result
            except Unavailable as e:
                delay = None if result.token_ids else self._backoff(attempt, e)
                if delay is None:
                    raise
            await asyncio.sleep(delay)
            attempt += 1

    def stream(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> AsyncStream:
        """The deltas as they come (`kwargs` as for Client.generate)."""
        return self._open(_request(prompt, kwargs), timeout)

    async def abort(self, request_id: str, abort_token: bytes) -> bool:
        """Abort a request of this client's from elsewhere, with the `abort_token` of its stream."""
        return (await self._retry(self._abort_call(request_id, abort_token))).found

    async def list_models(self) -> list[Model]:
        return [Model.from_proto(m) for m in (await self._retry(self._list_models_call())).models]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "AsyncStream", "Client", "DeltameshError", "Stream", "build_request"]

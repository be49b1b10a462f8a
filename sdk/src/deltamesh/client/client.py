"""Sync and asyncio clients for the deltamesh router."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from deltamesh.client.errors import DeltameshError, InvalidRequest, Unavailable, from_rpc_error
from deltamesh.client.structured import structured_message
from deltamesh.client.types import Delta, Result
from deltamesh.v1 import common_pb2, router_pb2, router_pb2_grpc

Prompt = str | Sequence[int] | Sequence[dict]

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)]


def build_request(
    prompt: Prompt,
    *,
    max_tokens: int = 16,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    logprobs: int | None = None,
    ignore_eos: bool = False,
    model: str = "",
    request_id: str | None = None,
    response_format: dict | None = None,
    structured_outputs: dict | None = None,
) -> router_pb2.GenerateRequest:
    """A prompt is text, token ids, or chat messages ({"role": ..., "content": ...}). Values the protocol
    cannot carry (negative counts, ids over 32 bits) raise InvalidRequest before anything is sent.

    Structured outputs, as the REST API takes them: `response_format` in OpenAI's shape ({"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}) or `structured_outputs` in vLLM's
    ({"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": EBNF}, {"json_object": True}, and
    "disable_any_whitespace")."""
    try:
        return _build(
            prompt,
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            stop,
            stop_token_ids,
            logprobs,
            ignore_eos,
            model,
            request_id,
            structured_message(structured_outputs, response_format),
        )
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


def _build(
    prompt,
    max_tokens,
    temperature,
    top_p,
    top_k,
    min_p,
    seed,
    stop,
    stop_token_ids,
    logprobs,
    ignore_eos,
    model,
    request_id,
    structured,
) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        model=model,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, top_k=top_k, min_p=min_p, ignore_eos=ignore_eos),
        stop=common_pb2.StopConditions(stop=list(stop), stop_token_ids=list(stop_token_ids)),
    )
    for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed), ("logprobs", logprobs)):
        if value is not None:
            setattr(req.sampling, name, value)
    if structured is not None:
        req.sampling.structured_outputs.CopyFrom(structured)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _channel_credentials(root_certificates: bytes | None, private_key: bytes | None, certificate_chain: bytes | None):
    if root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


class Stream:
    """Iterator of `Delta`s; `cancel()` (or leaving a `with` block early) aborts the request. `abort_token`
    (set once the first delta arrived) lets `Client.abort` stop the request from elsewhere."""

    def __init__(self, client: Client, request: router_pb2.GenerateRequest, timeout: float | None):
        self.client, self.request_id = client, request.request_id
        self._call = client._stub.Generate(request, timeout=timeout, metadata=client._metadata)
        self._done = False
        self.abort_token = b""

    def __iter__(self) -> Iterator[Delta]:
        try:
            for msg in self._call:
                self.abort_token = msg.abort_token or self.abort_token
                delta = Delta.from_proto(self.request_id, msg.delta)
                self._done = delta.finished
                yield delta
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def cancel(self) -> None:
        """Cancelling the call aborts the request in the mesh."""
        if not self._done:
            self._done = True
            self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
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
        creds = _channel_credentials(root_certificates, private_key, certificate_chain)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = (
            grpc.secure_channel(address, creds, options=_OPTIONS)
            if creds
            else grpc.insecure_channel(address, options=_OPTIONS)
        )
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.timeout, self.retries = timeout, retries

    def _retry(self, fn):
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if not isinstance(err, Unavailable) or attempt == self.retries:
                    raise err from None
                time.sleep(0.1 * 2**attempt)

    def generate(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> Result:
        """The whole result. `kwargs`: build_request's sampling keywords (max_tokens, temperature, top_p, top_k,
        min_p, seed, stop, stop_token_ids, logprobs, ignore_eos, model, request_id, response_format,
        structured_outputs)."""
        request = _request(prompt, kwargs)
        for attempt in range(self.retries + 1):
            result = Result(request.request_id)
            try:
                for delta in Stream(self, request, timeout or self.timeout):
                    result.add(delta)
                return result
            except Unavailable:
                # Safe to retry only if nothing was generated: the request never reached a worker.
                if result.token_ids or attempt == self.retries:
                    raise
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def stream(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> Stream:
        """The deltas as they come (`kwargs` as for generate)."""
        return Stream(self, _request(prompt, kwargs), timeout or self.timeout)

    def abort(self, request_id: str, abort_token: bytes) -> bool:
        """Abort a request of this client's from elsewhere, with the `abort_token` of its stream."""
        request = common_pb2.AbortRequest(request_id=request_id, abort_token=abort_token)
        return self._retry(lambda: self._stub.Abort(request, timeout=5, metadata=self._metadata)).found

    def list_models(self) -> list[router_pb2.Model]:
        request = router_pb2.ListModelsRequest()
        return list(self._retry(lambda: self._stub.ListModels(request, timeout=5, metadata=self._metadata)).models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    def __init__(self, client: AsyncClient, request: router_pb2.GenerateRequest, timeout: float | None):
        self.client, self.request_id = client, request.request_id
        self._call = client._stub.Generate(request, timeout=timeout, metadata=client._metadata)
        self._done = False
        self.abort_token = b""

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self._call:
                self.abort_token = msg.abort_token or self.abort_token
                delta = Delta.from_proto(self.request_id, msg.delta)
                self._done = delta.finished
                yield delta
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    async def cancel(self) -> None:
        """Cancelling the call aborts the request in the mesh."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.cancel()


class AsyncClient:
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
        creds = _channel_credentials(root_certificates, private_key, certificate_chain)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = (
            grpc.aio.secure_channel(address, creds, options=_OPTIONS)
            if creds
            else grpc.aio.insecure_channel(address, options=_OPTIONS)
        )
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.timeout, self.retries = timeout, retries

    async def _retry(self, make_call):
        for attempt in range(self.retries + 1):
            try:
                return await make_call()
            except grpc.aio.AioRpcError as e:
                err = from_rpc_error(e)
                if not isinstance(err, Unavailable) or attempt == self.retries:
                    raise err from None
                await asyncio.sleep(0.1 * 2**attempt)

    async def generate(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> Result:
        """The whole result (`kwargs` as for Client.generate: build_request's sampling keywords)."""
        request = _request(prompt, kwargs)
        for attempt in range(self.retries + 1):
            result = Result(request.request_id)
            try:
                async for delta in AsyncStream(self, request, timeout or self.timeout):
                    result.add(delta)
                return result
            except Unavailable:
                if result.token_ids or attempt == self.retries:
                    raise
                await asyncio.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def stream(self, prompt: Prompt, timeout: float | None = None, **kwargs) -> AsyncStream:
        """The deltas as they come (`kwargs` as for Client.generate)."""
        return AsyncStream(self, _request(prompt, kwargs), timeout or self.timeout)

    async def abort(self, request_id: str, abort_token: bytes) -> bool:
        """Abort a request of this client's from elsewhere, with the `abort_token` of its stream."""
        request = common_pb2.AbortRequest(request_id=request_id, abort_token=abort_token)
        return (await self._retry(lambda: self._stub.Abort(request, timeout=5, metadata=self._metadata))).found

    async def list_models(self) -> list[router_pb2.Model]:
        request = router_pb2.ListModelsRequest()
        return list(
            (await self._retry(lambda: self._stub.ListModels(request, timeout=5, metadata=self._metadata))).models
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "AsyncStream", "Client", "DeltameshError", "Stream", "build_request"]

"""bench/serve.py's backends: how a request is streamed and timed over the REST gateway (OpenAI completions or
chat completions) or the router's gRPC stream (the deltamesh SDK)."""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from bench.serve_args import sampling
from bench.serve_metrics import RequestOutput
from bench.serve_prompts import SampleRequest


class OpenAIBackend:
    """/v1/completions or /v1/chat/completions with stream=true, over one httpx connection pool."""

    def __init__(self, args: argparse.Namespace):
        import httpx

        self.chat = args.backend == "openai-chat"
        self.path = "/v1/chat/completions" if self.chat else "/v1/completions"
        self.base_url = args.base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limit = args.max_concurrency  # None: no cap (httpx's default of 100 would be a hidden one)
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            trust_env=False,  # never through a proxy
            timeout=httpx.Timeout(None, connect=30.0),  # whole-request deadline: --request-timeout
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        )
        self.model = ""

    async def server_info(self) -> dict:
        r = await self.client.get("/v1/models", timeout=30.0)
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        card = data[0]
        return {"model": card["id"], "max_model_len": card.get("max_model_len"), "vocab_size": None}

    def payload(self, req: SampleRequest, args: argparse.Namespace) -> dict:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        if args.ignore_eos:
            body["ignore_eos"] = True
        if args.response_format is not None:
            body["response_format"] = args.response_format
        return body | sampling(args)

    async def send(self, req: SampleRequest, out: RequestOutput, args: argparse.Namespace) -> None:
        body = self.payload(req, args)
        out.start_time = time.perf_counter()
        complete = False
        async with self.client.stream("POST", self.path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:500]}"
                return
            last_event = ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (":"), event/id fields
                ts = time.perf_counter()
                data = last_event = line[5:].strip()
                if data == "[DONE]":
                    complete = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    err = obj["error"]
                    out.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    continue
                if choices := obj.get("choices"):
                    c = choices[0]
                    if self.chat:
                        delta = c.get("delta") or {}
                        text = delta.get("content") or ""
                        if delta.get("role") and not text and not c.get("finish_reason") and not c.get("logprobs"):
                            continue  # the role announcement: no token yet
                    else:
                        text = c.get("text") or ""
                    out.token_event(ts)
                    out.generated_text += text
                    out.finish_reason = c.get("finish_reason") or out.finish_reason
                if usage := obj.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or out.output_tokens
                    if usage.get("prompt_tokens"):
                        out.prompt_len = usage["prompt_tokens"]
        if not out._chunks and not out.error:
            out.error = f"no token was streamed (last event: {last_event[:300]!r})"
        out.finish(complete)

    async def close(self) -> None:
        await self.client.aclose()


class GrpcBackend:
    """The router's Generate stream through the deltamesh SDK (deltamesh.client.AsyncClient)."""

    def __init__(self, args: argparse.Namespace):
        from deltamesh.client import AsyncClient

        self.client = AsyncClient(args.grpc_address, retries=0)
        self.model = ""

    async def server_info(self) -> dict:
        models = await self.client.list_models()
        if not models:
            raise RuntimeError("the router lists no model")
        m = models[0]
        return {"model": m.id, "max_model_len": m.max_model_len, "vocab_size": m.vocab_size}

    async def send(self, req: SampleRequest, out: RequestOutput, args: argparse.Namespace) -> None:
        from deltamesh.client import DeltameshError

        kwargs = dict(
            max_tokens=req.output_len,
            ignore_eos=args.ignore_eos,
            model=self.model,
            request_id=f"bench-{uuid.uuid4().hex}",
        )
        kwargs |= sampling(args)
        if args.response_format is not None:
            kwargs["response_format"] = args.response_format
        out.start_time = time.perf_counter()
        complete, n_tokens = False, 0
        try:
            async with self.client.stream(list(req.prompt), **kwargs) as stream:  # leaving early aborts it
                async for d in stream:
                    ts = time.perf_counter()
                    if d.token_ids:
                        out.token_event(ts)
                        n_tokens += len(d.token_ids)
                    out.generated_text += d.text
                    if d.usage.prompt_tokens:
                        out.prompt_len = d.usage.prompt_tokens
                    if d.finished:
                        out.finish_reason, complete = d.finish_reason, True
                        out.output_tokens = d.usage.completion_tokens or n_tokens
        except DeltameshError as e:
            out.error = str(e)
        out.finish(complete)

    async def close(self) -> None:
        await self.client.close()


def make_backend(args: argparse.Namespace):
    return GrpcBackend(args) if args.backend == "grpc" else OpenAIBackend(args)

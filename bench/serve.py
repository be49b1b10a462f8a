"""Online serving benchmark for deltamesh (and any OpenAI-compatible server), after `vllm bench serve`.

Sends `--num-prompts` requests of random token prompts to a running mesh, at `--request-rate` requests/s
(Poisson arrivals; `--burstiness` is the gamma shape, as in vLLM) and/or capped at `--max-concurrency`
requests in flight, streams every response and reports vLLM's serving metrics:

* request / input / output / total token throughput, over the benchmark's wall-clock duration;
* TTFT: time from sending a request to its first streamed token;
* TPOT: per request, (e2e latency - TTFT) / (output tokens - 1), for requests of more than one token;
* ITL: every gap between consecutive streamed chunks (deltas) of a request;
* E2E latency: time from sending a request to its last token;
* goodput: completed requests per second that met every SLO given with `--goodput` (ms), e.g.
  `--goodput ttft:500 tpot:50` (a request of one token counts a TPOT of 0, as in vLLM).

`--json-schema FILE|long` sends `response_format: json_schema` on every request (both OpenAI backends and grpc):
`long` is a schema whose outputs run past any `--output-len`, so every request still makes exactly `--output-len`
tokens, each sampled under the grammar (TPOT with structured outputs against plain requests at equal lengths).

Each latency is reported as mean, median, std and the `--metric-percentiles` (default p90, p99), in ms.
Output tokens per request come from the stream's usage when the server sends it (always for deltamesh),
else from the count of streamed chunks.

Backends:

* `openai`: POST {base}/v1/completions, `stream: true`, token-id prompts (`prompt: [ids]`) so prompt
  lengths are exact, `ignore_eos: true` + `max_tokens` so output lengths are exact,
  `stream_options.include_usage`;
* `openai-chat`: POST {base}/v1/chat/completions with random text built from the tokenizer's vocabulary
  (one user message); the prompt length reported is the server's usage.prompt_tokens (chat template
  included). The role-announcing first chunk (`delta.role`, no content) carries no token and is not timed;
* `grpc`: the deltamesh SDK's AsyncClient (router Generate stream), token-id prompts.

Usage (a mesh running: `.venv/bin/deltamesh serve`):

    .venv/bin/python bench/serve.py --backend openai --num-prompts 200 --request-rate 4 \\
        --input-len 512 --output-len 64 --save-result --result-file bench/results/serve.json
    .venv/bin/python -m bench.serve --backend grpc --max-concurrency 8 --num-prompts 64

Ctrl-C stops issuing requests, cancels those in flight (the server aborts them) and reports what finished;
a second Ctrl-C exits at once. Programmatic use: `run_benchmark(parse_args([...]))` returns the result dict.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, machine_info

DEFAULT_MODEL_DIR = ROOT / "models" / "deltamesh-tiny"
BACKENDS = ("openai", "openai-chat", "grpc")
SLO_NAMES = ("ttft", "tpot", "e2el")
METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
MAX_TEXT_FIT_ROUNDS = 8  # rounds to fit random chat text to its target token count


# ---------------------------------------------------------------------------------------------- prompts


@dataclass
class SampleRequest:
    prompt: list[int] | str  # token ids (openai, grpc) or text (openai-chat)
    prompt_len: int  # tokens sent (for text: the content's own tokens; the server's usage wins)
    output_len: int  # max_tokens requested (== tokens generated, with ignore_eos)


class Vocabulary:
    """What the benchmark needs of the model: how many token ids there are, which are special (never sent),
    and the tokenizer (text prompts only). Read from a Hugging Face checkpoint directory."""

    def __init__(self, model_dir: str | Path | None, vocab_size: int | None = None):
        self.model_dir = Path(model_dir) if model_dir else None
        self.tokenizer = None
        specials: set[int] = set()
        sizes = []
        if self.model_dir is not None:
            cfg = _read_json(self.model_dir / "config.json")
            text_cfg = cfg.get("text_config") or cfg
            if text_cfg.get("vocab_size"):
                sizes.append(int(text_cfg["vocab_size"]))
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                for c in (cfg, text_cfg):
                    value = c.get(key)
                    specials.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
            tok_path = self.model_dir / "tokenizer.json"
            if tok_path.is_file():
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(str(tok_path))
                sizes.append(self.tokenizer.get_vocab_size(with_added_tokens=True))
                added = _read_json(tok_path).get("added_tokens", [])
                specials.update(t["id"] for t in added if t.get("special"))
        if vocab_size:
            sizes.append(int(vocab_size))
        if not sizes:
            raise ValueError(
                f"cannot tell the vocabulary size: no config.json or tokenizer.json in {model_dir} "
                "(pass --model-dir, or use --backend grpc, whose server reports it)"
            )
        self.size = min(sizes)
        self.special_ids = sorted(i for i in specials if 0 <= i < self.size)
        mask = np.ones(self.size, dtype=bool)
        mask[self.special_ids] = False
        self.allowed = np.flatnonzero(mask)
        if len(self.allowed) == 0:
            raise ValueError("the vocabulary has no non-special tokens")

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), size=n)].tolist()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def random_text(self, rng: np.random.Generator, n: int) -> tuple[str, int]:
        """Text of about n tokens made of random non-special tokens; returns (text, its token count)."""
        if self.tokenizer is None:
            raise ValueError(f"--backend openai-chat needs a tokenizer.json in --model-dir ({self.model_dir})")
        text = self.tokenizer.decode(self.random_ids(rng, n), skip_special_tokens=True)
        ids = self.encode(text)
        for _ in range(MAX_TEXT_FIT_ROUNDS):  # re-encoding merges or splits tokens: trim / top up
            if len(ids) > n:
                text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            elif len(ids) < n:
                text += self.tokenizer.decode(self.random_ids(rng, n - len(ids)), skip_special_tokens=True)
            else:
                break
            ids = self.encode(text)
        return text, len(ids)


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """n lengths uniform in [length*(1-r), length*(1+r)] (integers, at least 1), as vLLM's random dataset."""
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def sample_requests(args: argparse.Namespace, vocab: Vocabulary) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    in_lens = sample_lengths(rng, args.num_prompts, args.input_len, args.range_ratio)
    out_lens = sample_lengths(rng, args.num_prompts, args.output_len, args.range_ratio)
    return [_random_request(args, vocab, rng, n_in, n_out) for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist())]


def warmup_request(args: argparse.Namespace, vocab: Vocabulary, like: SampleRequest) -> SampleRequest:
    """A request of `like`'s lengths whose prompt is none of the measured ones (its own random stream): with a
    server's prefix cache on, a warm-up on a measured prompt would make that request a cache hit."""
    rng = np.random.default_rng([args.seed, 2])  # (stream 1: arrival times)
    return _random_request(args, vocab, rng, like.prompt_len, like.output_len)


def _random_request(
    args: argparse.Namespace, vocab: Vocabulary, rng: np.random.Generator, n_in: int, n_out: int
) -> SampleRequest:
    """Random text (openai-chat) or token ids of about n_in tokens, asking for n_out."""
    if args.backend == "openai-chat":
        text, n = vocab.random_text(rng, n_in)
        return SampleRequest(text, n, n_out)
    return SampleRequest(vocab.random_ids(rng, n_in), n_in, n_out)


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is issued: gamma-distributed gaps of mean 1/rate
    (shape = burstiness; 1 = Poisson), rescaled so the last one lands at n/rate as vLLM does; all 0 at inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng([seed, 1])  # its own stream: prompts don't change the schedule
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times.tolist()


# --------------------------------------------------------------------------------------------- requests


@dataclass
class RequestOutput:
    prompt_len: int
    expected_output_len: int
    sent: bool = False  # False: never issued, or still waiting for a --max-concurrency slot when stopped
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per chunk after the first
    latency: float = 0.0  # seconds, send -> last token
    start_time: float = 0.0  # perf_counter() when sent
    queue_time: float = 0.0  # waiting for a --max-concurrency slot
    finish_reason: str | None = None
    generated_text: str = ""
    error: str = ""
    _last: float = 0.0
    _chunks: int = 0

    def token_event(self, ts: float) -> None:
        """A streamed chunk carrying generated token(s) arrived at ts."""
        if self._chunks == 0:
            self.ttft = ts - self.start_time
        else:
            self.itl.append(ts - self._last)
        self._last = ts
        self._chunks += 1

    def finish(self, complete: bool) -> None:
        self.latency = (self._last - self.start_time) if self._chunks else 0.0
        if not self.output_tokens:
            self.output_tokens = self._chunks
        if not self.error:
            if not self._chunks:
                self.error = "no token was streamed"
            elif not complete:
                self.error = "the stream ended before its end marker"
            elif self.finish_reason in ("abort", "error"):
                self.error = f"finish_reason {self.finish_reason}"
        self.success = not self.error


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
        return {"model": m.id, "max_model_len": m.max_model_len or None, "vocab_size": m.vocab_size or None}

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


# ---------------------------------------------------------------------------------------------- metrics


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/percentiles in ms of values in seconds (zeros when empty, as vLLM)."""
    a = np.asarray(values if values else [0.0], dtype=float) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        out[f"p{_pword(p)}"] = float(np.percentile(a, p))
    return out


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(
    outputs: list[RequestOutput], duration: float, goodput: dict[str, float], percentiles: list[float]
) -> dict[str, Any]:
    """vLLM's serving metrics (vllm/benchmarks/serve.py calculate_metrics) over the finished requests."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    itls = [x for o in ok for x in o.itl]
    all_tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0 for o in ok]
    tpots = [t for o, t in zip(ok, all_tpots) if o.output_tokens > 1]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    good = 0
    if goodput:
        per_slo = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            good += all(per_slo[k][i] <= v / 1000.0 for k, v in goodput.items())
    dur = duration if duration > 0 else float("nan")
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": sum(o.sent and not o.success for o in outputs),
        "not_sent": sum(not o.sent for o in outputs),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if goodput else None,
        "input_throughput": total_input / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
    }
    m.update(_peaks(ok))
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, percentiles).items():
            m[f"{stat}_{key}_ms"] = value
    return m


def _peaks(ok: list[RequestOutput]) -> dict[str, float]:
    """Peak output tokens in any one-second bucket, and the peak number of requests in flight."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(o.start_time for o in ok)
    buckets = np.zeros(int(math.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1)
    for o in ok:
        t = o.start_time + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            buckets[int(t - t0)] += 1
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return {"max_output_tokens_per_s": float(buckets.max()), "max_concurrent_requests": peak}


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt) if value is not None else 'n/a':<10}")

    row("Backend:", cfg["backend"])
    row("Model:", result["model"])
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("interrupted") or result["not_sent"]:
        row("Interrupted (Ctrl-C):", "yes" if result.get("interrupted") else "no")
        row("Requests not sent:", result["not_sent"])
    if cfg["max_concurrency"] is not None:
        row("Maximum request concurrency:", cfg["max_concurrency"])
    if not math.isinf(cfg["request_rate"]):
        row("Request rate configured (RPS):", cfg["request_rate"], ".2f")
        row("Burstiness:", cfg["burstiness"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Input token throughput (tok/s):", result["input_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for key, name, header in METRICS:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        for stat in ("mean", "median", "std", *(f"p{_pword(p)}" for p in cfg["metric_percentiles"])):
            label = stat.capitalize() if stat[0] != "p" else stat.upper()
            row(f"{label} {name} (ms):", result[f"{stat}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------- run


def _raise_fd_limit() -> None:
    """Many requests in flight need as many sockets; lift the soft limit to the hard one (best effort)."""
    with contextlib.suppress(Exception):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


class Interrupted(Exception):
    """Stopped before the measured run began."""


async def _until_stopped(aw, stop: asyncio.Event):
    """Await aw unless stop is set first (then cancel it and raise Interrupted)."""
    task, stopper = asyncio.ensure_future(aw), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise Interrupted("interrupted before the measured run")
    return task.result()


async def _send_once(backend, req: SampleRequest, args: argparse.Namespace, timeout: float) -> RequestOutput:
    out = RequestOutput(req.prompt_len, req.output_len)
    try:
        async with asyncio.timeout(timeout):
            await backend.send(req, out, args)
    except TimeoutError:
        out.error, out.success = f"no answer within {timeout:.0f}s", False
    except Exception as e:
        out.error, out.success = f"{type(e).__name__}: {e}", False
    return out


async def _ready_check(backend, req: SampleRequest, args: argparse.Namespace) -> None:
    """One request must succeed before the run (retried, once a second, until --ready-check-timeout)."""
    deadline = time.monotonic() + args.ready_check_timeout
    for _ in range(max(1, int(args.ready_check_timeout))):
        out = await _send_once(backend, req, args, max(1.0, min(args.request_timeout, deadline - time.monotonic())))
        if out.success or time.monotonic() + 1.0 > deadline:
            break
        await asyncio.sleep(1.0)
    if not out.success:
        raise RuntimeError(f"the initial test request failed; check the server and the arguments: {out.error}")


async def run_benchmark(args: argparse.Namespace, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run the benchmark described by args (see parse_args); returns the result dict (also saved when
    args.save_result). Setting `stop` stops issuing requests and cancels those in flight."""
    validate_args(args)
    stop = stop or asyncio.Event()
    _raise_fd_limit()
    backend = make_backend(args)
    target = args.grpc_address if args.backend == "grpc" else args.base_url
    try:
        try:
            info = await _until_stopped(backend.server_info(), stop)
        except (Interrupted, ValueError, RuntimeError):
            raise
        except Exception as e:  # connection refused, HTTP errors, gRPC status
            raise RuntimeError(f"cannot list the models of {target}: {type(e).__name__}: {e}") from None
        backend.model = args.model or info["model"]
        vocab = Vocabulary(args.model_dir, info.get("vocab_size"))
        requests = sample_requests(args, vocab)
        longest = max(r.prompt_len + r.output_len for r in requests)
        if info.get("max_model_len") and longest > info["max_model_len"]:
            raise ValueError(
                f"prompt + output of up to {longest} tokens exceeds the server's max_model_len "
                f"{info['max_model_len']}; lower --input-len/--output-len/--range-ratio"
            )
        warmup = warmup_request(args, vocab, requests[0])
        if args.ready_check_timeout > 0:
            _log(args, "Starting initial single prompt test run...")
            await _until_stopped(_ready_check(backend, warmup, args), stop)
        if args.num_warmups:
            _log(args, f"Warming up with {args.num_warmups} requests...")
            await _until_stopped(
                asyncio.gather(
                    *(_send_once(backend, warmup, args, args.request_timeout) for _ in range(args.num_warmups))
                ),
                stop,
            )
        dist = "Poisson process" if args.burstiness == 1.0 else "gamma distribution"
        _log(
            args,
            f"Traffic request rate: {args.request_rate}; burstiness {args.burstiness} ({dist}); "
            f"maximum request concurrency: {args.max_concurrency}",
        )
        outputs, duration, interrupted = await _issue(backend, requests, args, stop)
    finally:
        await backend.close()

    metrics = calculate_metrics(outputs, duration, args.goodput, args.metric_percentiles)
    t0 = min((o.start_time for o in outputs if o.start_time), default=0.0)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    if config.get("api_key"):
        config["api_key"] = "<redacted>"
    argv = _redact_argv(list(getattr(args, "_argv", sys.argv)))
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": argv,
        "command_line": shlex.join(argv),
        "backend": args.backend,
        "model": backend.model,
        "server": info,
        "target": target,
        "config": config,
        "machine": machine_info(),  # the client's: the server may be elsewhere
        "interrupted": interrupted,
        **metrics,
        # per request, in issue order; times in seconds (as vLLM), start times relative to the first send
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "expected_output_lens": [o.expected_output_len for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "tpots": [
            (o.latency - o.ttft) / (o.output_tokens - 1) if o.success and o.output_tokens > 1 else 0.0 for o in outputs
        ],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time - t0 if o.start_time else None for o in outputs],
        "queue_times": [o.queue_time for o in outputs],
        "finish_reasons": [o.finish_reason for o in outputs],
        "errors": [o.error for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
    }
    if args.save_result:
        path = Path(args.result_file or default_result_file(args, backend.model))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
        result["result_file"] = str(path)
    return result


async def _issue(backend, requests: list[SampleRequest], args: argparse.Namespace, stop: asyncio.Event):
    """Issue every request on its schedule, wait for them all (or for stop). Returns (outputs, duration,
    interrupted)."""
    from tqdm import tqdm

    outputs = [RequestOutput(r.prompt_len, r.output_len, error="not sent") for r in requests]
    schedule = arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    pbar = tqdm(total=len(requests), disable=args.disable_tqdm, dynamic_ncols=True)

    async def one(i: int, arrived: float) -> None:
        out = outputs[i]
        async with sem:
            out.queue_time = time.perf_counter() - arrived
            out.sent, out.error = True, ""
            try:
                async with asyncio.timeout(args.request_timeout):
                    await backend.send(requests[i], out, args)
            except TimeoutError:
                out.error, out.success = f"no answer within --request-timeout {args.request_timeout}s", False
            except asyncio.CancelledError:
                out.error, out.success = "cancelled (interrupted)", False
                raise
            except Exception as e:
                out.error, out.success = f"{type(e).__name__}: {e}", False
        pbar.update(1)

    start = time.perf_counter()
    tasks: list[asyncio.Task] = []
    for i, at in enumerate(schedule):
        wait = start + at - time.perf_counter()
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)
        if stop.is_set():
            break
        tasks.append(asyncio.create_task(one(i, time.perf_counter())))
    stopper = asyncio.create_task(stop.wait())
    try:
        if tasks:  # until all are done (each has a deadline) or stop
            all_done = asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.wait({all_done, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        interrupted = stop.is_set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stopper.cancel()
        pbar.close()
    duration = time.perf_counter() - start
    return outputs, duration, interrupted


def default_result_file(args: argparse.Namespace, model: str) -> str:
    dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return str(Path(args.result_dir) / f"{args.backend}-{args.request_rate}qps{conc}-{Path(model).name}-{dt}.json")


def _log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- args


# vllm bench serve's sampling flags, sent with every request under their API names (REST and gRPC alike)
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields of every request: --temperature and those of SAMPLING_FLAGS that are set."""
    fields = {name: getattr(args, name, None) for name in ("temperature", *SAMPLING_FLAGS)}
    return {name: value for name, value in fields.items() if value is not None}


def _goodput(items: list[str] | dict | None) -> dict[str, float]:
    if not items:
        return {}
    if isinstance(items, dict):
        return {k: float(v) for k, v in items.items()}
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME in {', '.join(SLO_NAMES)}, not {item!r}")
        out[name] = float(value)
        if out[name] < 0:
            raise ValueError(f"--goodput {item}: an SLO must be non-negative")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/serve.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions; grpc: the SDK",
    )
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="REST gateway (openai backends)")
    g.add_argument("--grpc-address", default="127.0.0.1:50051", help="router gRPC address (grpc backend)")
    g.add_argument("--model", default=None, help="model name to request (None: the server's first model)")
    g.add_argument(
        "--model-dir",
        "--tokenizer",
        dest="model_dir",
        default=str(DEFAULT_MODEL_DIR),
        help="checkpoint directory for the vocabulary (config.json) and tokenizer (tokenizer.json); "
        "must match the served model",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("DELTAMESH_API_KEY"),
        help="bearer token for the REST gateway (env DELTAMESH_API_KEY)",
    )
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s (inf: all at once; otherwise Poisson/gamma arrivals)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and arrival times")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds for one request, at most")
    g.add_argument(
        "--ready-check-timeout",
        type=float,
        default=60.0,
        help="seconds to retry an initial test request (0: no test request)",
    )
    g.add_argument("--num-warmups", type=int, default=0, help="warm-up requests before the measured run")
    g = p.add_argument_group("prompts")
    g.add_argument("--input-len", type=int, default=1024, help="prompt tokens (mean)")
    g.add_argument("--output-len", type=int, default=128, help="tokens to generate (mean)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths are uniform in [len*(1-r), len*(1+r)]")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested output tokens (the ignore_eos extension)",
    )
    g = p.add_argument_group("sampling, on every request (vllm bench serve's flags; unset: the server's default)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    for name in SAMPLING_FLAGS:
        kind = int if name == "top_k" else float
        g.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|long",
        help="send response_format json_schema on every request: the schema in FILE, or `long`, one whose outputs run "
        "past any --output-len (an array of at least 4096 short strings), so every request still makes exactly "
        "--output-len tokens, each under the grammar",
    )
    g = p.add_argument_group("report")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    g.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles to report")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-file", default=None, help="result JSON path (implies --save-result)")
    g.add_argument("--result-dir", default=".", help="directory of the default result file name")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--quiet", action="store_true", help="print neither progress messages nor the table")
    return p


def validate_args(args: argparse.Namespace) -> None:
    if isinstance(args.metric_percentiles, str):
        args.metric_percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    args.goodput = _goodput(args.goodput)
    if args.result_file:
        args.save_result = True
    args.response_format = _response_format(args.json_schema)
    checks = [
        (args.num_prompts >= 1, "--num-prompts must be at least 1"),
        (args.input_len >= 1 and args.output_len >= 1, "--input-len and --output-len must be at least 1"),
        (0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.request_rate > 0, "--request-rate must be positive (inf: all at once)"),
        (args.burstiness > 0, "--burstiness must be positive"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be at least 1"),
        (args.request_timeout > 0, "--request-timeout must be positive"),
        (all(0 < p <= 100 for p in args.metric_percentiles), "--metric-percentiles must be in (0, 100]"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


# Outputs that never complete before max_tokens: TPOT under a grammar at the same output lengths as plain requests
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 4096}},
    "required": ["items"],
    "additionalProperties": False,
}


def _response_format(json_schema: str | None) -> dict | None:
    if json_schema is None:
        return None
    schema = LONG_SCHEMA if json_schema == "long" else json.loads(Path(json_schema).read_text())
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args._argv = sys.argv if argv is None else [sys.argv[0], *argv]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = sys.argv if argv is None else [sys.argv[0], *argv]
    try:
        validate_args(args)
    except ValueError as e:
        parser.error(str(e))

    async def runner() -> dict:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        main_task = asyncio.current_task()

        def on_sigint() -> None:
            if stop.is_set():  # the second Ctrl-C: give up at once
                main_task.cancel()
                return
            print(
                "\ninterrupted: no more requests; cancelling those in flight (Ctrl-C again to quit)",
                file=sys.stderr,
                flush=True,
            )
            stop.set()

        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            return await run_benchmark(args, stop)
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)

    try:
        result = asyncio.run(runner())
    except (KeyboardInterrupt, asyncio.CancelledError, Interrupted):
        print("aborted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(format_table(result))
        if result["failed"]:
            errors = [e for e in result["errors"] if e and e != "not sent"][:5]
            print(f"{result['failed']} request(s) failed; first errors:", *errors, sep="\n  ", file=sys.stderr)
        if "result_file" in result:
            print(f"result: {result['result_file']}", file=sys.stderr)
    return 130 if result["interrupted"] else 0


def _redact_argv(argv: list[str]) -> list[str]:
    """The command line without the API key's value."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith("--api-key="):
            a = "--api-key=<redacted>"
        elif i > 0 and argv[i - 1] == "--api-key":
            a = "<redacted>"
        out.append(a)
    return out


def _jsonable(obj):
    """Strict JSON: infinite / NaN floats (e.g. request_rate inf) become the strings "inf" / "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    sys.exit(main())

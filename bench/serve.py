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
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_args import BACKENDS, LONG_SCHEMA, build_parser, parse_args, sampling, validate_args
from bench.serve_backends import OpenAIBackend, make_backend
from bench.serve_metrics import RequestOutput, calculate_metrics
from bench.serve_prompts import SampleRequest, Vocabulary, arrival_times, sample_requests, warmup_request
from bench.serve_report import build_result, format_table, save_result

# the programmatic API (run_benchmark(parse_args([...]))) and what tests build requests with
__all__ = [
    "BACKENDS",
    "LONG_SCHEMA",
    "OpenAIBackend",
    "SampleRequest",
    "Vocabulary",
    "main",
    "parse_args",
    "run_benchmark",
    "sample_requests",
    "sampling",
    "validate_args",
    "warmup_request",
]


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
    result = build_result(args, backend.model, info, target, outputs, metrics, interrupted)
    save_result(args, result)
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


def _log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate_args(args)
    except ValueError as e:
        build_parser().error(str(e))

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


if __name__ == "__main__":
    sys.exit(main())

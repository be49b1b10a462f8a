"""bench/serve.py's report: the result record (vLLM's result JSON: the run's settings, its metrics and every
request's times), where it is saved, and the table printed after a run."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import machine_info
from bench.serve_metrics import RequestOutput, percentile_label

METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


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
        for stat in ("mean", "median", "std", *(f"p{percentile_label(p)}" for p in cfg["metric_percentiles"])):
            label = stat.capitalize() if stat[0] != "p" else stat.upper()
            row(f"{label} {name} (ms):", result[f"{stat}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def build_result(
    args: argparse.Namespace,
    model: str,
    info: dict,
    target: str,
    outputs: list[RequestOutput],
    metrics: dict[str, Any],
    interrupted: bool,
) -> dict[str, Any]:
    """The run's record: its settings (the API key redacted), the server's card, the metrics and, per request in
    issue order, its lengths and times."""
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
        "model": model,
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
    return result


def save_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write the result JSON (with --save-result / --result-file); its path goes into the result."""
    if args.save_result:
        path = Path(args.result_file or default_result_file(args, result["model"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
        result["result_file"] = str(path)


def default_result_file(args: argparse.Namespace, model: str) -> str:
    dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    return str(Path(args.result_dir) / f"{args.backend}-{args.request_rate}qps{conc}-{Path(model).name}-{dt}.json")


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

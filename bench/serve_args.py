"""bench/serve.py's command line: its flags (vllm bench serve's), their checks, and the sampling fields and
response format every request carries."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT

DESCRIPTION = "Online serving benchmark for deltamesh (and any OpenAI-compatible server), after `vllm bench serve`."
DEFAULT_MODEL_DIR = ROOT / "models" / "deltamesh-tiny"
BACKENDS = ("openai", "openai-chat", "grpc")
SLO_NAMES = ("ttft", "tpot", "e2el")

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
        description=DESCRIPTION,
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
    args.response_format = _response_format(args.json_schema)
    return args

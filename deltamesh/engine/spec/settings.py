"""The speculative-decoding settings as a user of vLLM gives them: `--speculative-config` JSON, checked and turned
into the engine's own settings (torch-free: the CLI reads it for --help)."""

from __future__ import annotations

import json

MAX_SPECULATIVE_TOKENS = 4
# vLLM's names of MTP drafting for these models (its legacy per-model names too)
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
# The batch above which a step decodes without verification when no setting says otherwise. On the H200 the
# 35B-A3B shape's verify steps paid for themselves at every K up to batch 64, the largest measured, at the
# published acceptance (bench/RESULTS.md, bench/gpu_spec.py); beyond 64 nothing was measured, so drafting stops.
DEFAULT_DISABLE_BATCH_SIZE = 64


def parse_speculative_config(text: str) -> tuple[int, int | None]:
    """(speculative tokens, disable batch size or None) of vLLM's `--speculative-config` JSON; ValueError with
    the reason for anything this engine cannot serve (another method, a draft model, an out-of-range count)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(
            'speculative_config must be a JSON object, e.g. {"method": "mtp", "num_speculative_tokens": 2}'
        )
    method = spec.get("method", "mtp")
    if method not in MTP_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported (only the checkpoint's MTP module: 'mtp')"
        )
    known = {"method", "num_speculative_tokens", "disable_by_batch_size", "model"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"speculative_config: unsupported keys {unknown} (supported: {sorted(known)})")
    if spec.get("model") not in (None, ""):
        raise ValueError(
            "speculative_config: a separate draft model is not supported; MTP drafts with the checkpoint's own module"
        )
    k = check_tokens(spec.get("num_speculative_tokens"), "speculative_config num_speculative_tokens")
    disable = spec.get("disable_by_batch_size")
    if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
        raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer, got {disable!r}")
    return k, disable


def check_tokens(k: object, name: str = "speculative_tokens") -> int:
    """`k`, checked as a count of speculative tokens."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0: off), got {k!r}")
    return k

"""The speculative-decoding settings as a user of vLLM gives them: `--speculative-config` JSON, checked and turned
into the engine's own settings (torch-free: the CLI reads it for --help)."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

MAX_SPECULATIVE_TOKENS = 4
# vLLM's names of MTP drafting for these models (its legacy per-model names too)
MTP_METHODS = ("mtp", "qwen3_next_mtp", "qwen3_5_mtp")
# The batch above which a step decodes without verification when no setting says otherwise. On the H200 the
# 35B-A3B shape's verify steps paid for themselves at every K up to batch 64, the largest measured, at the
# published acceptance (bench/RESULTS.md, bench/gpu_spec.py); beyond 64 nothing was measured, so drafting stops.
DEFAULT_DISABLE_BATCH_SIZE = 64
DRAFT_VOCAB_KEY = "speculative_config draft_vocab"
DRAFT_VOCAB_HELP = (
    "Speculative decoding: draft over only these token ids (FR-Spec; SGLang's --speculative-token-map), which "
    "saves reading the whole LM head per draft. A token map file (a torch-saved 1-D tensor of ids, .pt, as "
    "SGLang's; or a JSON list of ids, .json), or N: the N lowest ids (for byte-level BPE tokenizers such as "
    "Qwen's, ids follow merge order, which roughly follows frequency; a map of your traffic, from "
    "`deltamesh token-map`, accepts more). Output is unchanged (drafts are verified); only acceptance can drop. Default: the whole vocabulary"
)
_COUNT = re.compile(r"[+-]?\d+")


class SpeculativeConfig(NamedTuple):
    tokens: int
    disable_batch_size: int | None
    draft_vocab: str | None  # the --speculative-draft-vocab setting (check_draft_vocab), None: the whole vocabulary


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The settings in vLLM's `--speculative-config` JSON (and our `draft_vocab`); ValueError with the reason for
    anything this engine cannot serve (another method, a draft model, an out-of-range count)."""
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
    known = {"method", "num_speculative_tokens", "disable_by_batch_size", "model", "draft_vocab"}
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
    draft_vocab = spec.get("draft_vocab")
    return SpeculativeConfig(
        k, disable, None if draft_vocab is None else check_draft_vocab(draft_vocab, DRAFT_VOCAB_KEY)
    )


def check_tokens(k: object, name: str = "speculative_tokens") -> int:
    """`k`, checked as a count of speculative tokens."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0: off), got {k!r}")
    return k


def check_draft_vocab(value: object, name: str = "speculative_draft_vocab") -> str:
    """`value` (a count N, or a token map's path) as the setting's text; the ids themselves are checked when the
    vocabulary is known (spec/draft_vocab.py)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{name} must be a count of token ids (N >= 1: the N lowest) or the path of a token map (.pt or .json), "
            f"got {value!r}"
        )
    value = value.strip()
    if draft_vocab_count(value) is not None and int(value) < 1:
        raise ValueError(f"{name} must be a count >= 1 of token ids (the N lowest) or a token map's path, got {value}")
    return value


def draft_vocab_count(setting: str) -> int | None:
    """N when the setting is a count, None when it is a token map's path."""
    return int(setting) if _COUNT.fullmatch(setting) else None

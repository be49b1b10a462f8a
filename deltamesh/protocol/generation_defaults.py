"""The model's own sampling defaults: what a request leaves unset takes the values its checkpoint's
generation_config.json recommends (Qwen3.5's: temperature, top_p, top_k), as vLLM (`--generation-config auto`, its
default) and SGLang serve it; `vllm` leaves them out, as vLLM's `--generation-config vllm` does; the server's own
overrides (vLLM's `--override-generation-config`, in the file's names) go over either. Torch-free: the router reads
it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

GenerationConfigSource = Literal["auto", "vllm"]

# generation_config.json's key -> (the SamplingParams field it sets, transformers' own default for it). As vLLM
# reads the file, a value equal to transformers' default is no recommendation (GenerationConfig.to_diff_dict), so
# that a file that merely spells out top_k 50 does not turn top-k on.
_RECOMMENDED = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def sampling_defaults(
    model_dir: str | Path, source: GenerationConfigSource = "auto", overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The SamplingParams fields the checkpoint recommends, by field name ({} under `vllm`, or without a file), with
    `overrides` (generation_config.json's names: check_overrides) over them, each taken as given."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if source == "auto" and path.is_file() else {}
    recommended = {
        field: config[key]
        for key, (field, transformers_default) in _RECOMMENDED.items()
        if config.get(key) is not None and config[key] != transformers_default
    }
    return recommended | {_RECOMMENDED[key][0]: value for key, value in (overrides or {}).items()}


def check_overrides(overrides: dict[str, Any]) -> None:
    """ValueError naming a key that sets nothing a request can leave unset (vLLM would drop it without a word)."""
    unknown = sorted(set(overrides) - set(_RECOMMENDED))
    if unknown:
        raise ValueError(f"cannot override {', '.join(unknown)}: the keys are {', '.join(_RECOMMENDED)}")

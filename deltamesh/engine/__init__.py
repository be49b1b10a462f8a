"""The in-process engine: Qwen3.5-family hybrid models with paged KV, GDN state slots, continuous batching
and chunked prefill.

Names are imported on first use (PEP 562): `from deltamesh.engine.defaults import DEFAULT_MODEL` stays free of torch, so
commands that never run a model (`deltamesh generate`, `health`, `loads`, `--help`) start in a fraction of a
second instead of paying torch's import."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DEFAULT_MODEL": "deltamesh.engine.defaults",
    "Completion": "deltamesh.engine.engine",
    "Engine": "deltamesh.engine.engine",
    "EngineConfig": "deltamesh.engine.engine_config",
    "EngineCore": "deltamesh.engine.core",
    "FinishReason": "deltamesh.engine.request",
    "PoolExhausted": "deltamesh.engine.cache",
    "RequestError": "deltamesh.protocol.requests",
    "RequestOutput": "deltamesh.engine.request",
    "Reservation": "deltamesh.engine.reservations",
    "SamplingParams": "deltamesh.protocol.sampling",
    "validate_request": "deltamesh.protocol.requests",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value

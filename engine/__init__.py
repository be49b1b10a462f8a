"""The in-process engine: Qwen3.5-family hybrid models with paged KV, GDN state slots, continuous batching
and chunked prefill."""

from engine.cache import PoolExhausted
from engine.core import EngineCore, Reservation
from engine.request import RequestError, validate_request
from engine.engine import Completion, Engine
from engine.engine_config import DEFAULT_MODEL, EngineConfig
from engine.request import FinishReason, RequestOutput
from engine.sampling import SamplingParams

__all__ = [
    "DEFAULT_MODEL",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "FinishReason",
    "PoolExhausted",
    "RequestError",
    "RequestOutput",
    "Reservation",
    "SamplingParams",
    "validate_request",
]

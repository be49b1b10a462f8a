"""One registry picks a backend per op, by priority: FlashInfer (GDN; SM100/SM90) > our Triton kernels
(attention, norms, activations, conv1d update) > FLA (GDN, Triton) > torch reference.

A backend is a loader that, given the device and the model's shapes, returns the ops it can run there
(possibly a subset, possibly none, with the reason). Selection can be forced for every op
(`"torch"`) or per op (`"gdn_decode=fla,paged_attention=torch"`), through the engine setting
`kernel_backend` or the DELTAMESH_KERNELS environment variable. The choice is logged once per engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

OPS = (
    "gdn_prefill",
    "gdn_decode",
    "gdn_verify",
    "conv1d_prefill",
    "conv1d_update",
    "conv1d_verify",
    "attention_inputs",
    "paged_attention",
    "sigmoid_gate",
    "rms_norm",
    "add_rms_norm",
    "gated_rms_norm",
    "silu_mul",
    "moe",
    "linear",
    "gate_linear",
    "gated_norm_linear",
    "add_rms_norm_linear",
)

log = structlog.get_logger("deltamesh.kernels")


@dataclass(frozen=True)
class ModelShapes:
    """What a backend may need to know to decide whether it supports a model."""

    dtype: torch.dtype
    state_dtype: torch.dtype
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    page_size: int


@dataclass(frozen=True)
class Backend:
    name: str
    priority: int  # higher is preferred
    # (device, shapes) -> (ops it provides, reason it provides none / only some)
    load: Callable[[torch.device, ModelShapes], tuple[dict[str, Callable], str]]


@dataclass
class Kernels:
    """The ops an engine runs with, and which backend each came from."""

    gdn_prefill: Callable
    gdn_decode: Callable
    gdn_verify: Callable  # speculative decoding: several tokens per sequence, the state after each kept
    conv1d_prefill: Callable
    conv1d_update: Callable
    conv1d_verify: Callable
    attention_inputs: Callable
    paged_attention: Callable
    sigmoid_gate: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    moe: Callable
    linear: Callable
    gate_linear: Callable
    gated_norm_linear: Callable
    add_rms_norm_linear: Callable
    chosen: dict[str, str] = field(default_factory=dict)


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    _BACKENDS[backend.name] = backend


def backends() -> list[str]:
    return sorted(_BACKENDS, key=lambda n: -_BACKENDS[n].priority)


def parse_override(spec: str | None) -> dict[str, str]:
    """'' -> {}, 'torch' -> every op on torch, 'gdn_decode=fla,...' -> per op."""
    spec = (spec or os.environ.get("DELTAMESH_KERNELS") or "").strip()
    if not spec or spec == "auto":
        return {}
    if "=" not in spec:
        return {op: spec for op in OPS}
    out = {}
    for part in spec.split(","):
        op, _, name = part.partition("=")
        op, name = op.strip(), name.strip()
        if op not in OPS:
            raise ValueError(f"unknown kernel op {op!r} in kernel override; ops are {', '.join(OPS)}")
        out[op] = name
    return out


def select_kernels(device: torch.device, shapes: ModelShapes, override: str | None = None) -> Kernels:
    forced = parse_override(override)
    for name in set(forced.values()):
        if name not in _BACKENDS:
            raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(backends())}")
    loaded: dict[str, dict[str, Callable]] = {}
    reasons: dict[str, str] = {}
    for name in backends():
        ops, reason = _BACKENDS[name].load(device, shapes)
        loaded[name] = ops
        if reason:
            reasons[name] = reason
    chosen: dict[str, str] = {}
    impls: dict[str, Callable] = {}
    for op in OPS:
        if op in forced:
            name = forced[op]
            if op not in loaded[name]:
                why = reasons.get(name, "op not provided")
                raise ValueError(f"kernel backend {name!r} cannot run {op} on {device}: {why}")
        else:
            name = next(n for n in backends() if op in loaded[n])
        chosen[op], impls[op] = name, loaded[name][op]
    log.info("kernels selected", device=str(device), chosen=chosen, unavailable=reasons or None)
    return Kernels(**impls, chosen=chosen)


def _load_torch(device: torch.device, shapes: ModelShapes) -> tuple[dict[str, Callable], str]:
    from deltamesh.kernels import torch_ref

    return {op: getattr(torch_ref, op) for op in OPS}, ""


register_backend(Backend("torch", 0, _load_torch))

"""The GEMV of linear layers at a few tokens (`gemv`; its kernel, `_gemv`, in triton_gemv_kernels.py), for plain and
block-scaled FP8 weights (kernels/fp8.py says what FP8 computes), with what can run in the same launch:

- a prologue on its input, the op that would otherwise be a kernel of its own just before the projection
  (`Prologue`: the attention's sigmoid output gate, GDN's gated RMSNorm, a residual add and RMSNorm);
- plain rows beside an FP8 weight (`tail`: GDN's b|a gates, which the FP8 checkpoints keep in bf16, beside its
  FP8 qkv|z projection), so a layer's projections of one input stay one launch.

FP8 weights are read as e4m3 bytes; the activations are quantized per group of 128 as they are loaded and the
weight's block scales folded into them, never dequantizing the weight in memory. Layers with few output rows split
K over more programs so every SM reads. No host synchronisation, so CUDA graphs capture it."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from deltamesh.kernels import pdl
from deltamesh.kernels.fp8 import BLOCK, Fp8Weight
from deltamesh.kernels.triton_gemv_kernels import ADD_NORM, GATED_NORM, PLAIN, SIGMOID_GATE, _gemv


class GemvConfig(NamedTuple):
    block_n: int  # divides BLOCK, so a program's rows share one row of weight scales
    block_k: int  # a multiple of BLOCK
    split_k: int  # slices of K, each its own program
    num_warps: int


# BLOCK_N rows by BLOCK_K columns per program: its float32 sums are 64 registers per thread at 4 warps.
GEMV_TILE = (16, 512)
# K is split until a layer has this many programs per SM (or a slice would be under two BLOCK_Ks).
GEMV_PROGRAMS_PER_SM = 2
ARRIVAL_COUNTERS = 4096  # blocks of rows times tokens a split call may have
# A weight this small stays in the L2 cache while a step's few tokens read it one program per token, so up to
# SMALL_WEIGHT_MAX_TOKENS tokens the GEMV reads it from HBM about once, in one launch where cuBLAS takes one or two
# (and a fused op's norm or gate one more): the MoE router, GDN's b|a gates in verify steps (K+1 rows a request)
# and decode batches of 2-4 (bench/RESULTS.md, "Linear layers" and "Small weights through the GEMV"). 8 MiB takes
# in the FP8 2048-row projections (o_proj, out_proj) too: about 5 % off 4-row steps (RESULTS, "Small weights up to 8 MiB"). Read at
# each call; 0: off.
SMALL_WEIGHT_BYTES = 8 << 20
SMALL_WEIGHT_MAX_TOKENS = 4


def weight_bytes(w) -> int:
    weight = w.weight if isinstance(w, Fp8Weight) else w
    return weight.numel() * weight.element_size()


def small_weight_gemv(tokens: int, w) -> bool:
    """Whether `tokens` tokens of a projection by `w` (an Fp8Weight or a plain weight) run the GEMV because the
    weight is small enough to be read from the L2 cache by every token after the first."""
    return 0 < tokens <= SMALL_WEIGHT_MAX_TOKENS and weight_bytes(w) <= SMALL_WEIGHT_BYTES


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    # Triton's CPU interpreter: a handful, so tests split K as a GPU does for narrow layers
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def gemv_config(
    m: int,
    n: int,
    k: int,
    device: torch.device,
    programs_per_sm: int = GEMV_PROGRAMS_PER_SM,
    tile: tuple[int, int] = GEMV_TILE,
) -> GemvConfig:
    """The GEMV's launch for m tokens of a layer [n, k]: one program per token and block of rows, K split while
    there are too few of them to keep every SM reading."""
    block_n, block_k = tile
    programs = triton.cdiv(n, block_n) * m
    split = 1
    while (
        programs * split < programs_per_sm * _multiprocessors(device)
        and k >= 4 * split * block_k
        and programs <= ARRIVAL_COUNTERS
    ):
        split *= 2
    return GemvConfig(block_n, block_k, split, 4)


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """Per token and block of rows, how many K slices have stored their sums; each call's last slice sets it back
    to 0."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the split-K GEMV's counters must exist before CUDA graph capture: run it eagerly first")
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


class Prologue(NamedTuple):
    """What the GEMV computes from x before the product (`_activation`): `kind` (SIGMOID_GATE, GATED_NORM,
    ADD_NORM), `other` (the gate, z or the residual: x's shape), the norm's weight and eps; ADD_NORM stores the
    residual sum and the normed rows [T, K] in `residual` and `normed`."""

    kind: int
    other: torch.Tensor
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    normed: torch.Tensor | None = None
    residual: torch.Tensor | None = None


def gemv(
    x: torch.Tensor,
    w,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    tail: torch.Tensor | None = None,
    prologue: Prologue | None = None,
) -> torch.Tensor:
    """`_gemv` for an Fp8Weight or a plain weight [N, K] (rows contiguous); x [T, K] (rows contiguous), any T;
    with a SIGMOID_GATE or GATED_NORM prologue, x and its `other` are [T, heads, head dim] (last dim contiguous).
    `tail`: plain rows [N_TAIL, K] computed in the same launch, output columns N.. (no bias then)."""
    fp8 = isinstance(w, Fp8Weight)
    weight, scale = (w.weight, w.scale) if fp8 else (w, w)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    n_tail = 0 if tail is None else tail.shape[0]
    config = config or gemv_config(m, n + n_tail, k, x.device)
    assert BLOCK % config.block_n == 0 and config.block_k % BLOCK == 0 and weight.stride(1) == 1
    assert x.stride(-1) == 1 and (tail is None or (bias is None and tail.stride(1) == 1 and tail.shape[1] == k))
    blocks = triton.cdiv(n, config.block_n) + triton.cdiv(n_tail, config.block_n)
    assert config.split_k == 1 or blocks * m <= ARRIVAL_COUNTERS
    out = torch.empty(m, n + n_tail, dtype=x.dtype, device=x.device)
    if m == 0:  # a data-parallel rank without tokens
        return out
    kind, other, norm_weight, eps, head = PLAIN, x, x, 0.0, 1
    if prologue is not None:
        kind, other, eps = prologue.kind, prologue.other, prologue.eps
        norm_weight = x if prologue.norm_weight is None else prologue.norm_weight
        assert other.shape == x.shape and other.stride(-1) == 1
        if kind in (SIGMOID_GATE, GATED_NORM):
            head = x.shape[-1]
            assert x.dim() == 3 and head & (head - 1) == 0 and config.block_k % head == 0
    add_norm = prologue if prologue is not None and kind == ADD_NORM else None  # (kind is PLAIN without one)
    normed = add_norm.normed if add_norm is not None else out
    residual = add_norm.residual if add_norm is not None else out
    split = config.split_k > 1
    partials = torch.empty(config.split_k, m, n + n_tail, dtype=torch.float32, device=x.device) if split else out
    arrivals = _arrivals(x.device) if split else out
    _gemv[(blocks, config.split_k, m)](
        x,
        other,
        norm_weight,
        weight,
        scale,
        tail if tail is not None else weight,
        bias if bias is not None else out,
        out,
        partials,
        arrivals,
        normed,
        residual,
        n,
        n_tail,
        k,
        x.stride(0),
        x.stride(1) if x.dim() == 3 else 0,
        other.stride(0),
        other.stride(1) if other.dim() == 3 else 0,
        weight.stride(0),
        scale.stride(0),
        tail.stride(0) if tail is not None else 0,
        out.stride(0),
        eps,
        fp8,
        bias is not None,
        kind.value,
        head,
        norm_weight.dtype == x.dtype,
        BLOCK,
        config.block_n,
        config.block_k,
        config.split_k,
        num_warps=config.num_warps,
        **pdl.kwargs(x.device),
    )
    return out

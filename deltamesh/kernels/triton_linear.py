"""Linear layers on the GPU, for plain (bf16) and block-scaled FP8 weights (kernels/fp8.py says what FP8
computes), and the activation quantization the fused MoE kernels share.

- Plain weights: cuBLAS at every size (it beat a Triton GEMV on the 35B-A3B projections: bench/RESULTS.md,
  "Linear layers"), except where a fused op of triton_fused_linear.py runs the GEMV with its prologue.
- FP8 weights, up to GEMV_MAX_TOKENS tokens: the GEMV of triton_gemv.py, which reads the weight as e4m3 bytes.
- FP8 weights, more tokens: the activations are quantized per token and group (`_quantize_groups`, one kernel)
  and cuBLAS's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm: 1x128 activation blocks, 128x128 weight
  blocks) runs on the e4m3 tensor cores. It takes 16-aligned token counts (the activations are padded with zero
  rows) and whole sets of 4 scale groups (K a multiple of 512): a layer that has not those runs the GEMV at any
  size, one program per token.
- A small weight (triton_gemv.SMALL_WEIGHT_BYTES: routers, GDN's b|a gates, FP8 o_proj and out_proj) at 2 to SMALL_WEIGHT_MAX_TOKENS tokens:
  the GEMV, plain or FP8, reading it from the L2 cache for every token after the first.
- A list of weights (the projections of one input): one output each; an FP8 weight and plain rows beside it run
  in one GEMV launch up to GEMV_MAX_TOKENS tokens (GDN's FP8 qkv|z with its bf16 b|a gates).
None synchronises with the host, so CUDA graphs capture them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.functional import ScalingType

from deltamesh.kernels import pdl
from deltamesh.kernels.fp8 import BLOCK, Fp8Weight, reference_linear
from deltamesh.kernels.triton_gemv import gemv, small_weight_gemv
from deltamesh.kernels.triton_gemv_kernels import quantized_rows
from deltamesh.kernels.triton_pdl import pdl_wait

# FP8 weights: up to this many tokens `_gemv` runs, past it cuBLAS's FP8 GEMM wins (bench/RESULTS.md, "Linear
# layers").
GEMV_MAX_TOKENS = 1


@triton.jit
def _quantize_groups(
    x, q, scales, M, K, stride_xm, stride_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = 0
):
    """Token t's GROUPS groups from group program_id(1) * GROUPS: e4m3 values and one scale each (tokens past
    M, the padding, are zeros)."""
    pdl_wait(PDL)  # after the kernel before (pdl.py)
    t = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = k < K
    a = tl.load(x + t * stride_xm + k, mask=k < tl.where(t < M, K, 0), other=0.0).to(tl.float32)
    values, scale = quantized_rows(a)
    tl.store(q + t * K + k, values, mask=ok)
    tl.store(scales + g * stride_sg + t, scale, mask=g * GROUP < K)


def quantize_activations(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_activations on the GPU in one kernel, padded with zero rows to `rows`; the scales [rows,
    groups] are stored token-fastest, as cuBLAS reads them."""
    m, k = x.shape
    rows = rows or m
    groups = triton.cdiv(k, BLOCK)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    per_program = 4
    _quantize_groups[(rows, triton.cdiv(groups, per_program))](
        x, q, scales, m, k, x.stride(0), scales.stride(1), BLOCK, per_program, **pdl.kwargs(x.device)
    )
    return q, scales


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None):
    """x [T, K] times w^T (+ bias): cuBLAS for a plain weight; for an Fp8Weight, the GEMV up to GEMV_MAX_TOKENS
    tokens (or at any size where the layer's shape does not suit cuBLAS's FP8 GEMM), `fp8_gemm` past it; a small
    weight (triton_gemv.small_weight_gemv) takes the GEMV at a few tokens. For a list of weights, the list of
    their outputs (torch_ref.linear)."""
    if isinstance(w, list):
        return _linears(x, w, bias)
    tokens = x.shape[0]
    if not isinstance(w, Fp8Weight):
        # a small weight at 2+ tokens (at one token cuBLAS is the faster: "Linear layers" in bench/RESULTS.md), in
        # the layouts the GEMV takes (F.linear takes any other)
        small = (
            tokens > 1
            and small_weight_gemv(tokens, w)
            and x.dim() == 2
            and x.dtype == w.dtype
            and w.stride(1) == 1
            and (bias is None or bias.is_contiguous())
        )
        return gemv(x if x.stride(-1) == 1 else x.contiguous(), w, bias) if small else F.linear(x, w, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if tokens <= GEMV_MAX_TOKENS or small_weight_gemv(tokens, w) or not fits_fp8_gemm(x, w):
        return gemv(x, w, bias)
    return fp8_gemm(x, w, bias)


def _linears(x: torch.Tensor, weights: list, bias: torch.Tensor | None) -> list[torch.Tensor]:
    """An FP8 weight and plain rows beside it in one GEMV launch at few tokens (views of one output); else one
    projection after the other."""
    assert bias is None, "a list of weights takes no bias"
    fp8_then_plain = len(weights) == 2 and isinstance(weights[0], Fp8Weight) and not isinstance(weights[1], Fp8Weight)
    if fp8_then_plain and x.shape[0] <= GEMV_MAX_TOKENS:
        out = gemv(x if x.stride(-1) == 1 else x.contiguous(), weights[0], tail=weights[1])
        return list(out.split([weights[0].weight.shape[0], weights[1].shape[0]], dim=-1))
    return [linear(x, w) for w in weights]


def fits_fp8_gemm(x: torch.Tensor, w: Fp8Weight) -> bool:
    """cuBLAS's block-scaled FP8 GEMM takes whole sets of 4 scale groups and 16-aligned output rows."""
    return x.shape[1] % (4 * BLOCK) == 0 and w.weight.shape[0] % 16 == 0


def fp8_gemm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The activations quantized per token and group, then cuBLAS's block-scaled FP8 GEMM (the tokens padded to
    a multiple of 16); x rows contiguous, the shapes as fits_fp8_gemm says."""
    if not x.is_cuda:  # Triton's CPU interpreter: no cuBLAS, the same arithmetic in torch
        return reference_linear(x, w, bias)
    m = x.shape[0]
    q, scales = quantize_activations(x, -(-m // 16) * 16)
    out = F.scaled_mm(
        q,
        w.weight.t(),
        scales,
        ScalingType.BlockWise1x128,
        w.scale.t(),
        ScalingType.BlockWise128x128,
        bias=bias,
        output_dtype=x.dtype,
    )
    return out[:m]

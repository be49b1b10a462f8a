"""FP8 weights as the kernels take them: float8 e4m3 values with one float32 scale per BLOCK x BLOCK tile (the
block-scaled format of Qwen's FP8 releases, kept as published), and the arithmetic every FP8 kernel follows.

A linear layer y = x W^T with an `Fp8Weight` is computed with activations quantized too, per token and group of
BLOCK input columns (each group scaled so its largest magnitude becomes 448, the e4m3 maximum), as serving
engines run these checkpoints: y = sum over groups g of (q(x)_g . q(W)_g) * scale_x[g] * scale_W[g], the dot
products of e4m3 values accumulated in float32. `reference_linear` spells that out in torch; `dequantize` gives
the weight the FP8 values stand for, which is what the CPU engine computes with."""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 128  # rows and columns of one weight scale's tile; columns of one activation scale's group
E4M3_MAX = 448.0


class Fp8Weight(NamedTuple):
    """weight: float8_e4m3fn [..., N, K]; scale: float32 [..., ceil(N / BLOCK), ceil(K / BLOCK)]."""

    weight: torch.Tensor
    scale: torch.Tensor


def kernel_operands(w) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(values, scales, is FP8) of a weight as a kernel takes it; a plain weight stands in for its own scales,
    which the kernel never reads."""
    return (w.weight, w.scale, True) if isinstance(w, Fp8Weight) else (w, w, False)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales) of a [..., rows, cols] weight, one scale per block (its largest magnitude
    over 448; 1 for an all-zero block), as the FP8 releases are written."""
    *lead, rows, cols = w.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.zeros(*lead, gr * bm, gc * bn, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w.float()
    tiles = padded.view(*lead, gr, bm, gc, bn)
    scales = tiles.abs().amax(dim=(-3, -1)) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (tiles / scales[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, gr * bm, gc * bn)[..., :rows, :cols].contiguous(), scales


def dequantize_blocks(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (BLOCK, BLOCK),
) -> torch.Tensor:
    """float32 weight of e4m3 values [..., rows, cols] and their per-block scales (quantize_blocks' inverse)."""
    rows, cols = weight.shape[-2:]
    bm, bn = block
    scales = scale.float().repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)
    return weight.float() * scales[..., :cols]


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight an Fp8Weight stands for."""
    return dequantize_blocks(w.weight, w.scale).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales [T, ceil(K / BLOCK)]) of activations [T, K], per token and group of BLOCK."""
    t, k = x.shape
    groups = -(-k // BLOCK)
    padded = torch.zeros(t, groups * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    padded = padded.view(t, groups, BLOCK)
    scales = padded.abs().amax(dim=-1).clamp_min(1e-10) / E4M3_MAX
    q = (padded / scales[..., None]).to(torch.float8_e4m3fn)
    return q.view(t, groups * BLOCK)[:, :k], scales


def reference_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 linear layer's result in float32 arithmetic (module docstring), in x's dtype."""
    q, scales = quantize_activations(x)
    k = x.shape[-1]
    xs = q.float().view(x.shape[0], -1) * scales.repeat_interleave(BLOCK, dim=-1)[:, :k]
    y = xs @ dequantize(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_moe(
    x,
    router_logits,
    w13: Fp8Weight,
    w2: Fp8Weight,
    top_k: int,
    norm_topk: bool,
    shared_w13: Fp8Weight,
    shared_w2: Fp8Weight,
    shared_gate,
) -> torch.Tensor:
    """kernels.moe with FP8 experts, each expert's projections computed by `reference_linear` (the activations
    quantized before gate/up and before down), one (token, choice) pair at a time: slow, for tests."""

    def expert(xt, gate_up: Fp8Weight, down: Fp8Weight) -> torch.Tensor:
        g, u = reference_linear(xt, gate_up).float().chunk(2, -1)
        return reference_linear((torch.nn.functional.silu(g) * u).to(x.dtype), down).float()

    probs = torch.softmax(router_logits.float(), -1)
    weights, experts = torch.topk(probs, top_k, -1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.sigmoid(shared_gate.float()) * expert(x, shared_w13, shared_w2)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(experts[t, j])
            pair = expert(x[t : t + 1], Fp8Weight(w13.weight[e], w13.scale[e]), Fp8Weight(w2.weight[e], w2.scale[e]))
            out[t] += weights[t, j] * pair[0]
    return out.to(x.dtype)

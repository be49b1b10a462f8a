"""FP8 block-scaled checkpoints, as Qwen publishes them: a quantized linear layer's `X.weight` is float8 e4m3
and `X.weight_scale_inv` holds one float per (block rows x block cols) tile, covering the weight with the last
tiles cut short; the real weight is the FP8 value times its tile's scale. Layers left in the model dtype (the
embedding, the LM head, norms, the GDN conv and gates, the routers) are stored as they are.

The loader dequantizes while it reads (the CPU engine, fp32 models) or, where the GPU kernels take FP8 weights
(weights.fp8_weights), keeps the quantized layers' values and scales as they are."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from deltamesh.kernels.fp8 import dequantize_blocks

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
FP8_DTYPES = (torch.float8_e4m3fn,)


class QuantizationError(ValueError):
    """The checkpoint's FP8 tensors and their scales do not fit together."""


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight of an FP8 [..., rows, cols] tensor and its [..., ceil(rows/bm), ceil(cols/bn)] scales."""
    rows, cols = weight.shape[-2:]
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    if tuple(scale_inv.shape[-2:]) != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise QuantizationError(
            f"scales of shape {tuple(scale_inv.shape)} do not tile a weight of shape "
            f"{tuple(weight.shape)} in {bm}x{bn} blocks (expected {grid})"
        )
    return dequantize_blocks(weight, scale_inv, block)


def dequantized(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    block: tuple[int, int] | None,
    keep: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every FP8 weight replaced by its float32 value, but those whose weight name
    `keep` names: their values and scales pass as they are. A weight and its scales may come in either order
    (different shards, even): each waits for the other. `block` None: the checkpoint must hold no FP8 tensor."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name.endswith(SCALE_SUFFIX) or tensor.dtype in FP8_DTYPES:
            if block is None:
                raise QuantizationError(f"{name}: an FP8 checkpoint tensor, but config.json has no quantization_config")
            if keep(name.removesuffix(SCALE_SUFFIX)):
                yield name, tensor
            elif name.endswith(SCALE_SUFFIX):
                name = name[: -len(SCALE_SUFFIX)]
                scales[name] = tensor
            else:
                weights[name] = tensor
            if name in weights and name in scales:
                yield name, dequantize(weights.pop(name), scales.pop(name), block)
        else:
            yield name, tensor
    if weights or scales:
        raise QuantizationError(
            f"FP8 weights without scales: {sorted(weights)[:4]}; scales without their FP8 weight: {sorted(scales)[:4]}"
        )

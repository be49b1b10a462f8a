"""Fused MoE experts in Triton, the shared expert included, with no host synchronisation (so a decode step with
MoE layers can be captured in a CUDA graph). Two paths, chosen by the number of tokens (`moe`):

- few tokens (a decode step, T <= DECODE_MAX_TOKENS): every (token, choice) pair reads its expert's weights
  directly, in two kernels (triton_moe_pairs.py). Two tokens routed to one expert read it twice, so past a few
  tokens the aligned path reads fewer bytes;
- more tokens: the pairs grouped by expert into blocks for `tl.dot`, in six kernels (triton_moe_aligned.py).

Expert parallelism: a rank holds experts [first, first + local) whole; a pair routed to another rank's expert is
skipped (the ranks' outputs are summed by the engine), the shared expert is computed as the rank holds it.

FP8 weights (`kernels.fp8.Fp8Weight`, all four or none): the same kernels read the e4m3 experts and their block
scales and compute as kernels/fp8.py says, the activations (x, then the SwiGLU output) quantized per token and
group of 128 (how each path does it: its module).
"""

from __future__ import annotations

import torch

from deltamesh.kernels import triton_fused, triton_linear
from deltamesh.kernels.triton_moe_aligned import GemmConfig, moe_aligned
from deltamesh.kernels.triton_moe_pairs import moe_pairs

# Up to this many tokens the pair-wise path runs (see the module docstring); from bench/gpu_moe.py's op rows.
DECODE_MAX_TOKENS = 4


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13,
    w2,
    top_k: int,
    norm_topk: bool,
    shared_w13,
    shared_w2,
    shared_gate: torch.Tensor,
    first_expert: int = 0,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """deltamesh.kernels.torch_ref.moe: the MoE layer's output [T, H] for x [T, H] (rows contiguous; the logits
    and the shared expert's gate [T, 1] may be row-strided views). The four weights are all plain or all
    `Fp8Weight`s (then computed as kernels/fp8.py says). `config` forces the aligned path's blocks. Under expert
    parallelism w13 and w2 hold experts [first_expert, first_expert + len(w13)) and only their pairs count."""
    assert x.stride(1) == 1 and router_logits.stride(1) == 1
    if config is None and x.shape[0] <= DECODE_MAX_TOKENS:
        return moe_pairs(x, router_logits, w13, w2, top_k, norm_topk, shared_w13, shared_w2, shared_gate, first_expert)
    shared = triton_linear.linear(triton_fused.silu_mul(triton_linear.linear(x, shared_w13)), shared_w2)
    return moe_aligned(x, router_logits, w13, w2, top_k, norm_topk, shared, shared_gate, config, first_expert)

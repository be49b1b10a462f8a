"""FlashInfer's Gated DeltaNet kernels (SM90 Hopper and SM100 Blackwell paths; FlashInfer dispatches by
architecture), driven straight from the engine's slot pools.

- Prefill: `chunk_gated_delta_rule` over the step's varlen prefill chunks, reading and writing the pooled
  states in place through `state_indices` (no gather/scatter). It wants bf16/fp16 q/k/v with head dim 128,
  fp32 gates with the decay in linear space (alpha = exp(g)).
- Decode: `gated_delta_rule_decode_pretranspose` on the pool with `initial_state_indices`; it takes the gates
  before activation and L2-normalises q/k itself. fp32 state runs FlashInfer's T=1 kernel, bf16 state its
  fast path.
Both use the K-last `[slot, HV, V, K]` state layout the engine's pools already have.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltamesh.kernels.registry import Backend, ModelShapes, register_backend


def _supported(device: torch.device, shapes: ModelShapes) -> str:
    if device.type != "cuda":
        return "needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"needs sm_90 or newer (device is sm_{major}{minor})"
    if shapes.linear_key_head_dim != 128 or shapes.linear_value_head_dim != 128:
        return "GDN head dims must be 128"
    return ""


def _load(device: torch.device, shapes: ModelShapes) -> tuple[dict[str, Callable], str]:
    reason = _supported(device, shapes)
    if reason:
        return {}, reason
    try:
        from flashinfer import chunk_gated_delta_rule
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose
    except ImportError as e:
        return {}, f"flashinfer is not installed ({e})"

    from deltamesh.kernels.triton_gates import gdn_gates

    def gdn_prefill(q, k, v, a, b, A_log, dt_bias, seq_lens, cu_seqlens, state_pool, state_idx):
        alpha, beta = gdn_gates(a, b, A_log, dt_bias)  # one fused kernel: exp(g) and sigmoid(b)
        return chunk_gated_delta_rule(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            g=alpha,
            beta=beta,
            initial_state=state_pool,
            output_state=state_pool,
            state_indices=state_idx,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            max_seqlen=max(seq_lens),
        )

    def gdn_decode(q, k, v, a, b, A_log, dt_bias, state_pool, state_idx):
        # the kernel writes every row of `output` in bf16; left to FlashInfer, its fp32-state path zero-fills a
        # new one first: one more kernel per layer and step
        bf16 = v.dtype == torch.bfloat16
        output = torch.empty((v.shape[0], 1) + v.shape[1:], dtype=v.dtype, device=v.device) if bf16 else None
        out, _ = gated_delta_rule_decode_pretranspose(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            None,
            A_log,
            a.unsqueeze(1),
            dt_bias,
            b.unsqueeze(1),
            initial_state=state_pool,
            initial_state_indices=state_idx,
            use_qk_l2norm=True,
            output=output,
        )
        return out.squeeze(1)

    if shapes.dtype not in (torch.bfloat16, torch.float16):
        return {}, "needs bf16/fp16 activations (fp32 models keep the exact torch reference)"
    return {"gdn_prefill": gdn_prefill, "gdn_decode": gdn_decode}, ""


register_backend(Backend("flashinfer", 20, _load))

"""FLA's Triton Gated DeltaNet kernels: the fallback on CUDA GPUs FlashInfer does not cover (and for head
dims other than 128). FLA has no state-pool indices, so pooled states are gathered before and scattered
after each call; gates go in raw (the kernels apply softplus / sigmoid themselves)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltamesh.kernels.registry import Backend, ModelShapes, register_backend


def _load(device: torch.device, shapes: ModelShapes) -> tuple[dict[str, Callable], str]:
    if device.type != "cuda":
        return {}, "needs a CUDA device"
    if max(shapes.linear_key_head_dim, shapes.linear_value_head_dim) > 256:
        return {}, "GDN head dims above 256"
    if shapes.dtype == torch.float32:
        return {}, "fp32 models keep the exact torch reference (FLA's dots would run in tf32)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        return {}, f"fla-core is not installed ({e})"

    def gates(A_log, dt_bias):
        return dict(
            use_gate_in_kernel=True,
            A_log=A_log.float(),
            dt_bias=dt_bias.float(),
            use_beta_sigmoid_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        )

    def gdn_prefill(q, k, v, a, b, A_log, dt_bias, seq_lens, cu_seqlens, state_pool, state_idx):
        cu_cpu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        cu_cpu[1:] = torch.tensor(seq_lens).cumsum(0)
        out, final = chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            a[None],
            b[None],
            initial_state=state_pool[state_idx].float(),
            output_final_state=True,
            cu_seqlens=cu_seqlens.long(),
            cu_seqlens_cpu=cu_cpu,
            **gates(A_log, dt_bias),
        )
        state_pool[state_idx] = final.to(state_pool.dtype)
        return out[0]

    def gdn_decode(q, k, v, a, b, A_log, dt_bias, state_pool, state_idx):
        out, final = fused_recurrent_gated_delta_rule(
            q[:, None],
            k[:, None],
            v[:, None],
            g=a[:, None],
            beta=b[:, None],
            initial_state=state_pool[state_idx].float(),
            output_final_state=True,
            **gates(A_log, dt_bias),
        )
        state_pool[state_idx] = final.to(state_pool.dtype)
        return out[:, 0]

    return {"gdn_prefill": gdn_prefill, "gdn_decode": gdn_decode}, ""


register_backend(Backend("fla", 10, _load))

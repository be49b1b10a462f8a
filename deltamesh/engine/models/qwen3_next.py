"""Qwen3-Next (80B-A3B): MoE on the layers `decoder_sparse_step` / `mlp_only_layers` select, dense MLP
elsewhere; its GDN projections are stored fused and grouped by key head (`in_proj_qkvz`, `in_proj_ba`),
which we split into the Qwen3.5 layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) on load."""

from collections.abc import Iterator

import torch

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models.base import HybridLM
from deltamesh.engine.models.layers import MLP, FeedForward, SparseMoE


class Qwen3NextForCausalLM(HybridLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> FeedForward:
        if cfg.moe_layers[layer]:
            return SparseMoE(cfg, self.fp8)
        return MLP(cfg.hidden_size, cfg.intermediate_size, self.fp8)

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        prefix, _, leaf = name.rpartition(".in_proj_")
        if leaf == "qkvz.weight":
            yield from self._split_qkvz(prefix, tensor)
        elif leaf == "ba.weight":
            yield from self._split_ba(prefix, tensor)
        else:
            yield name, tensor

    def regroups(self, name: str) -> bool:
        return name.endswith((".in_proj_qkvz.weight", ".in_proj_ba.weight"))

    def _split_qkvz(self, prefix: str, w: torch.Tensor):
        """Rows are grouped per key head: [q (dk) | k (dk) | v (r*dv) | z (r*dv)], r = HV / HK."""
        c = self.cfg
        hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        r = c.linear_num_value_heads // hk
        q, k, v, z = w.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
        flat = lambda x: x.reshape(-1, w.shape[-1])  # noqa: E731 - heads back to rows, head-major
        yield f"{prefix}.in_proj_qkv.weight", torch.cat([flat(q), flat(k), flat(v)])
        yield f"{prefix}.in_proj_z.weight", flat(z)

    def _split_ba(self, prefix: str, w: torch.Tensor):
        """Rows are grouped per key head: [b (r) | a (r)]."""
        hk = self.cfg.linear_num_key_heads
        r = self.cfg.linear_num_value_heads // hk
        b, a = w.view(hk, 2 * r, -1).split([r, r], dim=1)
        yield f"{prefix}.in_proj_b.weight", b.reshape(-1, w.shape[-1])
        yield f"{prefix}.in_proj_a.weight", a.reshape(-1, w.shape[-1])

"""The multi-token-prediction (MTP) module Qwen3.5 and Qwen3-Next checkpoints ship beside the model (`mtp.*`):
the draft model of speculative decoding (engine/spec/).

At position p it reads the target model's hidden state h_p (after the final norm) and the embedding of the token
at p+1, and predicts the token at p+2:

    x = fc([pre_fc_norm_embedding(embed(token_{p+1})) | pre_fc_norm_hidden(h_p)])      fc: [hidden, 2 * hidden]
    x = decoder layer (full gated attention over the MTP's own KV at positions <= p, then the MLP; MoE in the MoE
        models, as the main model's layer of the same index)
    g_p = norm(x);  logits = lm_head(g_p)                      (embedding and LM head shared with the main model)

Drafting k tokens chains it: the step at p+1 reads the token just drafted and g_p in place of h_{p+1}, as vLLM's
and SGLang's MTP drafters do (`mtp_num_hidden_layers` layers are taken in turn; the released models have one).
The attention layer's KV lives in the main KV pool as one more full-attention layer (`kv_layer`), so it is paged,
handed over, shared by the prefix cache and rolled back exactly as the main model's KV is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models.layers import FeedForward, GatedAttention, ModuleListOf, RMSNorm, WeightSlot, _param
from deltamesh.kernels import Kernels
from deltamesh.kernels.batch import StepBatch

if TYPE_CHECKING:
    from deltamesh.engine.cache import KVPagePool
    from deltamesh.engine.models.base import HybridLM


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int, mlps: list[FeedForward], fp8: bool = False):
        """`cfg`: this rank's config (a parallel rank's shard); `kv_layer`: the KV pool layer of the first MTP
        layer's attention; `mlps`: each MTP layer's feed-forward block (the family's, models/base.py)."""
        from deltamesh.engine.models.base import DecoderLayer

        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = _param(h, 2 * h)  # kept in the model dtype (an FP8 checkpoint's is dequantized on load)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers: ModuleListOf[DecoderLayer] = ModuleListOf(
            DecoderLayer(cfg, GatedAttention(cfg, kv_layer + i, fp8), mlp) for i, mlp in enumerate(mlps)
        )
        self.norm = RMSNorm(h, eps)

    def weight_slots(self, prefix: str = "mtp") -> dict[str, WeightSlot]:
        slots = {
            f"{prefix}.fc.weight": WeightSlot(self.fc),
            f"{prefix}.pre_fc_norm_embedding.weight": WeightSlot(self.pre_fc_norm_embedding.weight),
            f"{prefix}.pre_fc_norm_hidden.weight": WeightSlot(self.pre_fc_norm_hidden.weight),
            f"{prefix}.norm.weight": WeightSlot(self.norm.weight),
        }
        for i, layer in enumerate(self.layers):
            slots |= layer.weight_slots(f"{prefix}.layers.{i}")
        return slots

    def forward(
        self,
        model: HybridLM,
        next_ids: torch.Tensor,  # [T] the token after each position
        hidden: torch.Tensor,  # [T, hidden] the target's (or the previous draft step's) normed hidden states
        batch: StepBatch,  # the positions (and their KV slots) the step writes and attends over
        kv_pool: KVPagePool,
        kernels: Kernels,
        step: int = 0,
    ) -> torch.Tensor:
        """The normed MTP hidden states g [T, hidden] (model.logits(g) are the draft logits)."""
        tp = model.tp
        emb = model.embed_ids(next_ids)
        x = torch.cat([self.pre_fc_norm_embedding(emb, kernels), self.pre_fc_norm_hidden(hidden, kernels)], dim=-1)
        residual = kernels.linear(x, self.fc)
        layer = self.layers[step % len(self.layers)]
        rope = model.rotary.cos_sin(batch.positions, residual.dtype)
        mixer = layer.mixer
        assert isinstance(mixer, GatedAttention)  # an MTP layer's mixer is full attention (__init__)
        mixed = mixer.mix(layer.input_norm(residual, kernels), batch, rope, kv_pool, kernels)
        h = mixer.output(mixed, kernels)
        if tp:  # partial sums of each rank's heads, as in HybridLM.after_mix
            h = tp.all_reduce(h)
        x, residual = kernels.add_rms_norm(h, residual, layer.post_attention_norm.weight, layer.post_attention_norm.eps)
        h = layer.mlp(x, kernels)
        if tp:
            h = tp.all_reduce(h)
        return kernels.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]

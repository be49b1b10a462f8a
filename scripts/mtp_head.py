"""The MTP module Qwen3.5 and Qwen3-Next checkpoints ship (`mtp.*`), built from transformers' own layers of a
model's family: transformers does not implement it (it drops `mtp.*` on load), so this is the reference the
engine's models/mtp.py is tested against (tests/hf_checkpoints.py) and what scripts/make_default_mtp.py trains.

As vLLM's qwen3_5_mtp.py / qwen3_next_mtp.py name and wire it: the next token's embedding and the target's hidden
state (after its final norm), each RMS-normed, concatenated (embedding first) and projected by `fc`; one
full-attention decoder layer of the family (its MLP that of the main layer of the same index); a final norm. The
embedding and the LM head are the model's."""

from __future__ import annotations

import copy

import torch
from torch import nn


class MtpHead(nn.Module):
    def __init__(self, model: nn.Module):
        """`model`: transformers' causal LM of the family (its config and layer classes are used, not its weights)."""
        super().__init__()
        cfg = copy.deepcopy(model.config)
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers  # MTP layer 0 is full attention
        norm, layer = type(model.model.norm), type(model.model.layers[0])
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = (
            norm(h, eps=eps),
            norm(h, eps=eps),
            norm(h, eps),
        )
        self.layers = nn.ModuleList([layer(cfg, 0)])

    def forward(self, model, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Normed MTP hidden states [..., T, h] of whole sequences, causal: position p reads the token at p+1
        (`next_ids[..., p]`) and `hidden[..., p, :]`. Leading batch dimension optional."""
        single = next_ids.dim() == 1
        if single:
            next_ids, hidden, positions = next_ids[None], hidden[None], positions[None]
        emb = model.model.embed_tokens(next_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
        rope = model.model.rotary_emb(x, positions)
        x = self.norm(self.layers[0](x, position_embeddings=rope, attention_mask=mask, position_ids=positions))
        return x[0] if single else x

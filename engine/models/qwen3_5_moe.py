"""Qwen3.5 MoE (35B-A3B ... 397B-A17B): every layer has routed experts plus a gated shared expert."""

from torch import nn

from engine.config import ModelConfig
from engine.models.base import HybridLM
from engine.models.layers import SparseMoE


class Qwen3_5MoeForCausalLM(HybridLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg)

"""Qwen3.5 MoE (35B-A3B ... 397B-A17B): every layer has routed experts plus a gated shared expert."""

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models.base import HybridLM
from deltamesh.engine.models.layers import FeedForward, SparseMoE


class Qwen3_5MoeForCausalLM(HybridLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> FeedForward:
        return SparseMoE(cfg, self.fp8)

"""Qwen3.5 dense (0.8B ... 27B): every layer has a SwiGLU MLP."""

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models.base import HybridLM
from deltamesh.engine.models.layers import MLP, FeedForward


class Qwen3_5ForCausalLM(HybridLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> FeedForward:
        return MLP(cfg.hidden_size, cfg.intermediate_size, self.fp8)

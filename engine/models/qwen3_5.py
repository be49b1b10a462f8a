"""Qwen3.5 dense (0.8B ... 27B): every layer has a SwiGLU MLP."""

from torch import nn

from engine.config import ModelConfig
from engine.models.base import HybridLM
from engine.models.layers import MLP


class Qwen3_5ForCausalLM(HybridLM):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size)

"""One model file per family; `MODEL_CLASSES` maps a config family to its class."""

from deltamesh.engine.models.base import HybridLM
from deltamesh.engine.models.qwen3_5 import Qwen3_5ForCausalLM
from deltamesh.engine.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from deltamesh.engine.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[HybridLM]] = {
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}

__all__ = ["HybridLM", "MODEL_CLASSES"]

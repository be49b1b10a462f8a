"""Model configuration: the text-model fields the engine needs, read from a Hugging Face config.json.

Released Qwen3.5 checkpoints are vision-language wrappers (`model_type: qwen3_5` with a `text_config`);
we read the text config only. Older Qwen3-Next configs keep rope settings at the top level, newer ones in
`rope_parameters`; both are accepted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# model_type (outer or text) -> family
_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ConfigError(ValueError):
    """The checkpoint's config.json cannot be served by this engine."""


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # full (gated softmax) attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    hidden_act: str
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = field(default=())
    # (first, count) of the routed experts one rank holds under expert parallelism (engine/parallel.py); None: all
    local_experts: tuple[int, int] | None = None
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # The weight block (rows, cols) of an FP8 block-scaled checkpoint (engine/quantization.py); None: unquantized
    fp8_block: tuple[int, int] | None = None
    # decoder layers of the checkpoint's multi-token-prediction module (`mtp.*`, models/mtp.py); 0: none
    mtp_layers: int = 0

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        return cls.from_hf_dict(json.loads(cfg_path.read_text()))

    @classmethod
    def from_hf_dict(cls, raw: dict) -> ModelConfig:
        outer_type = raw.get("model_type", "")
        text = raw.get("text_config") or raw
        family = _MODEL_TYPES.get(text.get("model_type", "")) or _MODEL_TYPES.get(outer_type)
        if family is None:
            raise ConfigError(f"unsupported model_type {outer_type!r}; this engine serves {', '.join(FAMILIES)}")
        n_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
        if len(layer_types) != n_layers or set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
            raise ConfigError(f"layer_types must list {n_layers} of {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r}")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only default/mrope)")
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        rotary_dim = int(head_dim * partial)
        mrope_section = rope.get("mrope_section")
        if mrope_section is not None and 2 * sum(mrope_section) != rotary_dim:
            raise ConfigError(f"mrope_section {mrope_section} does not cover rotary dim {rotary_dim}")

        num_experts = int(text.get("num_experts", 0) or 0) if family != "qwen3_5" else 0
        if family == "qwen3_next":
            sparse_step = int(text.get("decoder_sparse_step", 1))
            mlp_only = set(text.get("mlp_only_layers") or [])
            moe_layers = tuple(
                num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(n_layers)
            )
        else:
            moe_layers = tuple(num_experts > 0 for _ in range(n_layers))

        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        quant = raw.get("quantization_config") or text.get("quantization_config")
        return cls(
            family=family,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text.get("num_key_value_heads", text["num_attention_heads"])),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            mrope_section=tuple(mrope_section) if mrope_section else None,
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            hidden_act=text.get("hidden_act", "silu"),
            intermediate_size=int(text.get("intermediate_size", 0) or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
            # Qwen3.5-MoE always renormalises its top-k weights; Qwen3-Next makes it a setting.
            norm_topk_prob=family == "qwen3_5_moe" or bool(text.get("norm_topk_prob", True)),
            moe_layers=moe_layers,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype).replace("torch.", ""),
            fp8_block=_fp8_block(quant) if quant else None,
            # Qwen3.5 names it mtp_num_hidden_layers, Qwen3-Next num_nextn_predict_layers; absent, one (as vLLM reads
            # them): whether the checkpoint ships the module shows when it is loaded
            mtp_layers=int(text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 1))),
        )


def _fp8_block(quant: dict) -> tuple[int, int]:
    """The weight block of a `quantization_config` this engine serves: FP8 e4m3 weights with one float scale per
    block and activations quantized at run time, as Qwen and DeepSeek publish them. Anything else is refused
    here, before any weight is read."""
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config: quant_method {method!r} is not supported (only block-scaled 'fp8')")
    problems = []
    if quant.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {quant.get('fmt')!r} (only e4m3)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {quant.get('activation_scheme')!r} (only dynamic)")
    if quant.get("scale_fmt", "float") != "float":
        problems.append(f"scale_fmt {quant.get('scale_fmt')!r} (only float)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        problems.append(f"weight_block_size {block!r} (per-tensor FP8 is not supported: two positive ints needed)")
    if problems:
        raise ConfigError("quantization_config (fp8) not supported: " + "; ".join(problems))
    assert isinstance(block, list)  # (checked above)
    return block[0], block[1]

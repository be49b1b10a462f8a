"""Config parsing and the checkpoint loader on the layouts real checkpoints use."""

import json

import pytest
import torch
from hf_checkpoints import _COMMON, _MROPE, randomize

from deltamesh.engine.config import ConfigError, ModelConfig
from deltamesh.engine.core import EngineCore
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.models.layers import Rotary
from deltamesh.engine.weights import WeightError

QWEN35_9B_TEXT = {  # the text part of a released Qwen3.5 config, as published
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 248044,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}


def test_vision_language_wrapper_reads_the_text_config():
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3_5", "text_config": QWEN35_9B_TEXT, "vision_config": {}})
    assert cfg.family == "qwen3_5" and cfg.rotary_dim == 64 and cfg.conv_dim == 2 * 2048 + 4096
    assert cfg.layer_types.count("full_attention") == 8 and cfg.layer_types[3] == "full_attention"
    assert cfg.eos_token_ids == (248044,)


def test_qwen3_next_top_level_rope_and_sparse_layers():
    raw = {
        **QWEN35_9B_TEXT,
        "model_type": "qwen3_next",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    del raw["rope_parameters"]
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_theta == 1e6
    assert cfg.moe_layers[:6] == (False, True, False, False, False, True)


def test_unsupported_models_get_a_clear_error():
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf_dict({"model_type": "llama", "num_hidden_layers": 2})


def test_mrope_reduces_to_plain_rope_for_text_and_matches_transformers():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    hf_cfg = Qwen3_5TextConfig(**QWEN35_9B_TEXT | {"num_hidden_layers": 4})
    rotary = Rotary(ModelConfig.from_hf_dict(QWEN35_9B_TEXT), torch.device("cpu"))
    hf = Qwen3_5TextRotaryEmbedding(hf_cfg)
    pos = torch.randint(0, 5000, (3, 17))  # distinct t/h/w streams, as for an image
    cos, sin = rotary.cos_sin(pos, torch.float32)
    hf_cos, hf_sin = hf(torch.zeros(1), pos[:, None, :])
    assert torch.allclose(cos, hf_cos[0], atol=1e-6) and torch.allclose(sin, hf_sin[0], atol=1e-6)
    text = pos[0]
    assert torch.equal(rotary.cos_sin(text.expand(3, -1), torch.float32)[0], rotary.cos_sin(text, torch.float32)[0])


def test_sharded_vision_language_checkpoint_loads_text_weights_only(tmp_path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(text_config=dict(**_COMMON, intermediate_size=96, rope_parameters=_MROPE), vision_config=vision)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    randomize(hf, 0)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    core = EngineCore(EngineConfig(model=str(tmp_path)))
    ids = list(range(3, 40))
    [res] = [core.make_request(ids, core_params()) for _ in range(1)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    got = run_to_first_logits(core, res)
    assert (got - ref).abs().max() < 1e-4


def core_params():
    from deltamesh.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0)


def run_to_first_logits(core, req):
    from deltamesh.engine.scheduler import ScheduledItem

    req.slot, req.pages = core.state_pool.alloc(), core.kv_pool.alloc(core.kv_pool.pages_for(req.num_tokens))
    try:
        return core.runner.execute([ScheduledItem(req, req.num_tokens)])[0]
    finally:
        core.scheduler.free(req)


def test_missing_and_unexpected_weights_are_named(tmp_path, hf_checkpoints):
    from safetensors.torch import load_file, save_file

    src = hf_checkpoints["qwen3_5"]
    tensors = load_file(src / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    dropped = dict(tensors)
    del dropped["model.layers.1.linear_attn.A_log"]
    save_file(dropped, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match="layers.1.linear_attn.A_log"):
        EngineCore(EngineConfig(model=str(tmp_path)))
    save_file({**tensors, "model.layers.0.surprise.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match="surprise"):
        EngineCore(EngineConfig(model=str(tmp_path)))


def test_dummy_weights_need_only_a_config_and_are_seeded(tmp_path):
    cfg = dict(
        QWEN35_9B_TEXT,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        vocab_size=500,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    cfg["rope_parameters"] = dict(cfg["rope_parameters"], mrope_section=[2, 1, 1])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = EngineCore(EngineConfig(model=str(tmp_path), load_format="dummy", seed=7))
    b = EngineCore(EngineConfig(model=str(tmp_path), load_format="dummy", seed=7))
    assert a.tokenizer is None
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    req = a.make_request(list(range(20)), core_params())
    assert torch.isfinite(run_to_first_logits(a, req)).all()


def test_auto_dtype_on_the_cpu_keeps_a_bf16_checkpoint_only_on_a_bf16_cpu(tmp_path, monkeypatch):
    """--dtype auto on the CPU: float32 for a float32 checkpoint (the embedded model, the test checkpoints); a
    bfloat16 checkpoint stays bfloat16 where the CPU computes bf16 natively, float32 where it would be emulated;
    an explicit --dtype is kept."""
    from deltamesh.engine import engine_config

    bf16_dir, fp32_dir = tmp_path / "bf16", tmp_path / "fp32"
    for path, dtype in ((bf16_dir, "bfloat16"), (fp32_dir, "float32")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**QWEN35_9B_TEXT, "dtype": dtype}))

    def resolved(model, native, dtype="auto", device="cpu"):
        engine_config._bf16_checkpoint_on_a_bf16_cpu.cache_clear()
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
        return EngineConfig(model=str(model), dtype=dtype, device=device).torch_dtype()

    assert resolved(bf16_dir, native=True) == torch.bfloat16
    assert resolved(bf16_dir, native=False) == torch.float32
    assert resolved(fp32_dir, native=True) == torch.float32
    assert resolved(tmp_path / "missing", native=True) == torch.float32
    assert resolved(bf16_dir, native=True, dtype="float32") == torch.float32
    assert resolved(fp32_dir, native=False, dtype="bfloat16") == torch.bfloat16
    engine_config._bf16_checkpoint_on_a_bf16_cpu.cache_clear()

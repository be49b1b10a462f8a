"""The FP8 block-scaled format piece by piece: tiles cut short at the edges, weight and scales in any order,
and clear refusals for what the engine does not serve."""

import json

import pytest
import torch
from test_config_and_loading import QWEN35_9B_TEXT

from deltamesh.engine.config import ConfigError, ModelConfig
from deltamesh.engine.core import EngineCore
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.quantization import QuantizationError, dequantize, dequantized
from deltamesh.kernels.fp8 import quantize_blocks as quantize
from scripts.write_fp8_checkpoint import write_fp8_checkpoint

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_dequantize_applies_each_tiles_scale_with_edge_tiles_cut_short():
    rows, cols, block = 200, 300, (128, 64)  # 2 x 5 tiles, the last row and column of tiles partial
    w = torch.randn(rows, cols).to(torch.float8_e4m3fn)
    s = torch.rand(2, 5) + 0.5
    expected = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            expected[r, c] = w[r, c].float() * s[r // 128, c // 64]
    assert torch.equal(dequantize(w, s, block), expected)


def test_quantize_round_trips_within_e4m3_precision():
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)  # columns of very different magnitudes
    q, s = quantize(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = dequantize(q, s, (128, 128))
    assert ((back - w).abs() <= w.abs() / 16 + s.max() / 64).all()  # 3 mantissa bits; subnormals at the floor


def test_weight_and_scales_pair_up_in_any_order():
    w1, s1 = quantize(torch.randn(16, 16), (8, 8))
    w2, s2 = quantize(torch.randn(16, 16), (8, 8))
    stream = [
        ("a.weight_scale_inv", s1),
        ("n.weight", torch.ones(3)),
        ("b.weight", w2),
        ("a.weight", w1),
        ("b.weight_scale_inv", s2),
    ]
    out = dict(dequantized(stream, (8, 8)))
    assert set(out) == {"a.weight", "b.weight", "n.weight"} and torch.equal(out["n.weight"], torch.ones(3))
    assert torch.equal(out["a.weight"], dequantize(w1, s1, (8, 8)))


def test_broken_fp8_checkpoints_are_named():
    w, s = quantize(torch.randn(16, 16), (8, 8))
    with pytest.raises(QuantizationError, match="without scales: \\['a.weight'\\]"):
        list(dequantized([("a.weight", w)], (8, 8)))
    with pytest.raises(QuantizationError, match="no quantization_config"):
        list(dequantized([("a.weight", w)], None))
    with pytest.raises(QuantizationError, match="do not tile"):
        list(dequantized([("a.weight", w), ("a.weight_scale_inv", s)], (4, 4)))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": None}, "per-tensor FP8 is not supported"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ],
)
def test_unsupported_quantization_configs_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**QWEN35_9B_TEXT, "quantization_config": {**FP8, **change}})


def test_published_fp8_config_is_read():
    wrapped = {"model_type": "qwen3_5", "text_config": QWEN35_9B_TEXT, "quantization_config": FP8}
    assert ModelConfig.from_hf_dict(wrapped).fp8_block == (128, 128)
    assert ModelConfig.from_hf_dict(QWEN35_9B_TEXT).fp8_block is None


def test_engine_refuses_an_unsupported_checkpoint_before_reading_weights(tmp_path, hf_checkpoints):
    fp8 = write_fp8_checkpoint(hf_checkpoints["qwen3_5"], tmp_path / "fp8", (8, 8))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="activation_scheme 'static'"):
        EngineCore(EngineConfig(model=str(fp8)))


def test_a_sharded_checkpoint_stays_sharded_and_loads(tmp_path, hf_checkpoints):
    from hf_checkpoints import load_hf

    src = tmp_path / "sharded"
    load_hf(hf_checkpoints["qwen3_5_moe"]).save_pretrained(src, max_shard_size="200KB")
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", (8, 8))
    shards = sorted(p.name for p in fp8.glob("*.safetensors"))
    assert shards == sorted(p.name for p in src.glob("*.safetensors")) and len(shards) > 1
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"] in shards
    single = write_fp8_checkpoint(hf_checkpoints["qwen3_5_moe"], tmp_path / "single", (8, 8))
    a, b = EngineCore(EngineConfig(model=str(fp8))), EngineCore(EngineConfig(model=str(single)))
    assert torch.equal(a.model.layers[1].mlp.w13, b.model.layers[1].mlp.w13)  # the same weights either way

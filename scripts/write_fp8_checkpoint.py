"""Write a checkpoint in the FP8 block-scaled format Qwen publishes its FP8 releases in, from a bf16 / fp32 one:
every 2-D linear weight of the language model becomes float8 e4m3 with one float32 scale per block
(`X.weight_scale_inv`, the largest magnitude of the block over 448), except the layers Qwen's releases keep in
full precision (embedding, LM head, norms, the GDN conv and its a/b gates, the routers); config.json gains the
`quantization_config` those releases carry.

    python scripts/write_fp8_checkpoint.py SRC DST [--block 128,128]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltamesh.kernels.fp8 import quantize_blocks

# Substrings of the module names Qwen's FP8 releases leave unquantized.
KEPT = (
    "embed_tokens",
    "lm_head",
    "norm",
    "conv1d",
    "in_proj_a.",
    "in_proj_b.",
    "in_proj_ba.",
    "mlp.gate.",
    "shared_expert_gate",
    "visual",
)


def quantized_name(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in KEPT)


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """One output shard per input shard (same names, one in memory at a time), an index when there are
    several, config.json with the quantization_config, and the other files copied."""
    dst.mkdir(parents=True, exist_ok=True)
    kept_modules, weight_map = [], {}
    shards = sorted(src.glob("*.safetensors"))
    for path in shards:
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if quantized_name(name, t):
                    tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t, block)
                else:
                    tensors[name] = t.contiguous()
                    if name.endswith(".weight") and t.dim() == 2:
                        kept_modules.append(name[: -len(".weight")])
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, path.name)
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": kept_modules,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for other in src.iterdir():  # tokenizer, generation config, chat template
        if (
            other.is_file()
            and other.suffix != ".safetensors"
            and other.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy(other, dst / other.name)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--block", default="128,128", help="rows,cols of one scale's block")
    args = p.parse_args()
    rows, cols = (int(x) for x in args.block.split(","))
    print(write_fp8_checkpoint(args.src, args.dst, (rows, cols)))


if __name__ == "__main__":
    main()

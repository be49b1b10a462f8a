"""Linear layers with FP8 weights on one GPU (kernels/triton_fp8.py) against the bf16 layer (cuBLAS), for every
projection of a model's shape, replayed from CUDA graphs.

- `op` rows: per projection and token count: bf16 cuBLAS, the GEMV kernel with bf16 and with FP8 weights, and the
  FP8 layer as the engine runs it (the GEMV up to GEMV_MAX_TOKENS, then activation quantization + cuBLAS's
  block-scaled FP8 GEMM); the FP8 and bf16 floors (bytes read and written at the measured HBM copy rate).
- `step` rows: the sum over one forward pass's projections (every layer, LM head excluded) at each token count.
- `sweep` rows (`--sweep`): the GEMV's time per tile (triton_fp8.GemvConfig), bf16 and FP8 weights, which sets
  GEMV_CONFIG.

    python bench/gpu_fp8.py --out bench/results/gpu_fp8.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, RESULTS, ints, print_table, write_result  # noqa: E402
from bench.gpu_common import graph_ms, hbm_bandwidth, machine_info  # noqa: E402
from deltamesh.engine.config import FULL_ATTENTION, ModelConfig  # noqa: E402
from deltamesh.kernels import triton_fp8  # noqa: E402
from deltamesh.kernels.fp8 import BLOCK, Fp8Weight, quantize_blocks  # noqa: E402


def projections(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out rows, in columns, how many per forward pass) of the model's FP8-quantized projections."""
    full = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    linear = len(cfg.layer_types) - full
    rows = [
        ("attention qkv", 2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim,
         cfg.hidden_size, full),
        ("attention o_proj", cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, full),
        ("GDN in_proj qkvz", cfg.conv_dim + cfg.linear_value_dim, cfg.hidden_size, linear),
        ("GDN out_proj", cfg.hidden_size, cfg.linear_value_dim, linear),
    ]  # fmt: skip
    if cfg.num_experts:
        inter = cfg.shared_expert_intermediate_size
        rows += [("shared expert gate_up", 2 * inter, cfg.hidden_size, len(cfg.layer_types)),
                 ("shared expert down", cfg.hidden_size, inter, len(cfg.layer_types))]  # fmt: skip
    else:
        rows += [("MLP gate_up", 2 * cfg.intermediate_size, cfg.hidden_size, len(cfg.layer_types)),
                 ("MLP down", cfg.hidden_size, cfg.intermediate_size, len(cfg.layer_types))]  # fmt: skip
    return rows


def op_rows(cfg: ModelConfig, tokens: list[int], bandwidth: float) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k, count in projections(cfg):
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) / k**0.5
        wq = Fp8Weight(*quantize_blocks(w))
        for t in tokens:
            x = torch.randn(t, k, generator=g, device="cuda", dtype=torch.bfloat16)
            io = 2 * t * (k + n)
            row = {"bench": "op", "projection": name, "n": n, "k": k, "per_pass": count, "tokens": t,
                   "bf16_ms": graph_ms(lambda: F.linear(x, w)), "fp8_ms": graph_ms(lambda: triton_fp8.linear(x, wq)),
                   "bf16_floor_ms": (2 * n * k + io) / bandwidth * 1e3,
                   "fp8_floor_ms": (n * k + wq.scale.numel() * 4 + io) / bandwidth * 1e3}  # fmt: skip
            if t <= 16:
                row["bf16_gemv_ms"] = graph_ms(lambda: triton_fp8.gemv(x, w))
                row["fp8_gemv_ms"] = graph_ms(lambda: triton_fp8.gemv(x, wq))
            row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
            row["fp8_of_floor"] = row["fp8_floor_ms"] / row["fp8_ms"]
            rows.append(row)
    return rows


def step_rows(ops: list[dict]) -> list[dict]:
    rows = []
    for t in sorted({r["tokens"] for r in ops}):
        mine = [r for r in ops if r["tokens"] == t]
        keys = [key for key in ("bf16_ms", "bf16_gemv_ms", "bf16_floor_ms", "fp8_ms", "fp8_floor_ms") if key in mine[0]]
        total = {key: sum(r[key] * r["per_pass"] for r in mine) for key in keys}
        rows.append({"bench": "step", "tokens": t, **total, "saved_ms": total["bf16_ms"] - total["fp8_ms"]})
    return rows


def sweep_rows(cfg: ModelConfig, tokens: list[int]) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    grid = [(bn, bk, warps) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for warps in (2, 4, 8)]
    for name, n, k, _ in projections(cfg):
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) / k**0.5
        for weights, label in ((w, "bf16"), (Fp8Weight(*quantize_blocks(w)), "fp8")):
            for t in tokens:
                x = torch.randn(t, k, generator=g, device="cuda", dtype=torch.bfloat16)
                for tile in map(lambda c: triton_fp8.GemvConfig(*c), grid):
                    rows.append({"bench": "sweep", "projection": name, "weights": label, "tokens": t,
                                 "config": "/".join(map(str, tile)),
                                 "ms": graph_ms(lambda c=tile: triton_fp8.gemv(x, weights, None, c)),
                                 "chosen": tile == triton_fp8.GEMV_CONFIG})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-35b-a3b"))
    p.add_argument("--tokens", type=ints, default=[1, 4, 16, 64, 256, 4096])
    p.add_argument("--sweep", action="store_true", help="also time the kernel's tiles")
    p.add_argument("--out", default=str(RESULTS / "gpu_fp8.json"))
    args = p.parse_args()
    assert BLOCK == 128
    bandwidth = hbm_bandwidth()
    print(f"measured: HBM copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    cfg = ModelConfig.from_dir(args.model)
    ops = op_rows(cfg, args.tokens, bandwidth)
    print_table(ops, ["projection", "n", "k", "tokens", "bf16_ms", "bf16_gemv_ms", "bf16_floor_ms", "fp8_ms",
                      "fp8_gemv_ms", "fp8_floor_ms", "fp8_speedup", "fp8_of_floor"])  # fmt: skip
    steps = step_rows(ops)
    print_table(steps, ["tokens", "bf16_ms", "bf16_gemv_ms", "bf16_floor_ms", "fp8_ms", "fp8_floor_ms", "saved_ms"])
    rows = ops + steps
    if args.sweep:
        sweep = sweep_rows(cfg, [t for t in args.tokens if t <= triton_fp8.GEMV_MAX_TOKENS])
        for key in sorted({(r["projection"], r["weights"], r["tokens"]) for r in sweep}):
            best = sorted((r for r in sweep if (r["projection"], r["weights"], r["tokens"]) == key),
                          key=lambda r: r["ms"])  # fmt: skip
            chosen = next(r for r in best if r["chosen"]) if any(r["chosen"] for r in best) else None
            print_table(best[:3] + ([chosen] if chosen and chosen not in best[:3] else []),
                        ["projection", "weights", "tokens", "config", "ms", "chosen"])  # fmt: skip
        rows += sweep
    write_result(args.out, {"model": args.model, "rows": rows}, machine_info())
    print("wrote", args.out)


if __name__ == "__main__":
    main()

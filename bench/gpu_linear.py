"""Linear layers on one GPU (kernels/triton_linear.py, triton_gemv.py): the GEMV against cuBLAS, bf16 and FP8
weights, for every projection of a model's shape at decode-sized token counts and more.

Each time is one call's share of a CUDA graph that runs the projection over as many distinct weights as a
forward pass has of it (at least enough to exceed the L2 cache), as a decode step reads them; a single call
replayed alone would read its weight from L2 and pay a graph launch of its own.

- `op` rows: per projection and token count: bf16 cuBLAS, the bf16 GEMV, the FP8 layer past the GEMV (cuBLAS's
  block-scaled FP8 GEMM), the FP8 GEMV; the bf16 and FP8 floors (bytes at the measured HBM copy rate).
- `pass` rows: the sum over one forward pass's projections (LM head excluded) at each token count.
- `sweep` rows (`--sweep`): the pass sum per GEMV tile and split target at one token (triton_gemv.GEMV_TILE,
  GEMV_PROGRAMS_PER_SM), which set those defaults.

    python bench/gpu_linear.py --sweep --out bench/results/gpu_linear.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, RESULTS, ints, print_table, write_result
from bench.gpu_common import graph_ms, hbm_bandwidth, machine_info
from deltamesh.engine.config import FULL_ATTENTION, ModelConfig
from deltamesh.kernels import triton_gemv, triton_linear
from deltamesh.kernels.fp8 import BLOCK, Fp8Weight, quantize_blocks

L2_BYTES = 3 * 50 << 20  # three times the H200's L2


def projections(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """(name, out rows, in columns, how many per forward pass) of the model's projections, LM head excluded."""
    full = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    linear = len(cfg.layer_types) - full
    rows = [
        (
            "attention qkv",
            2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim,
            cfg.hidden_size,
            full,
        ),
        ("attention o_proj", cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, full),
        ("GDN in_proj", cfg.conv_dim + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads, cfg.hidden_size, linear),
        ("GDN out_proj", cfg.hidden_size, cfg.linear_value_dim, linear),
    ]
    if cfg.num_experts:
        inter = cfg.shared_expert_intermediate_size
        layers = len(cfg.layer_types)
        rows += [
            ("router + shared gate", cfg.num_experts + 1, cfg.hidden_size, layers),
            ("shared expert gate_up", 2 * inter, cfg.hidden_size, layers),
            ("shared expert down", cfg.hidden_size, inter, layers),
        ]
    else:
        rows += [
            ("MLP gate_up", 2 * cfg.intermediate_size, cfg.hidden_size, len(cfg.layer_types)),
            ("MLP down", cfg.hidden_size, cfg.intermediate_size, len(cfg.layer_types)),
        ]
    return rows


class Ring:
    """`count` distinct copies of a projection's weight, bf16 and FP8, as a forward pass holds them."""

    def __init__(self, n: int, k: int, per_pass: int, generator: torch.Generator):
        self.count = max(per_pass, -(-L2_BYTES // (2 * n * k)))
        w = torch.randn(n, k, generator=generator, device="cuda", dtype=torch.bfloat16) / k**0.5
        self.bf16 = [w.clone() for _ in range(self.count)]
        q, s = quantize_blocks(w)
        self.fp8 = [Fp8Weight(q.clone(), s.clone()) for _ in range(self.count)]

    def ms(self, fn, weights) -> float:
        """One call's share of a graph that calls fn(w) for every copy (compiled, and the split-K counters
        made, by graph_ms's eager calls before the capture)."""

        def chain():
            for w in weights:
                fn(w)

        return graph_ms(chain) / len(weights)


def op_rows(cfg: ModelConfig, rings: dict, tokens: list[int], bandwidth: float) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for (name, n, k, count), ring in rings.items():
        for t in tokens:
            x = torch.randn(t, k, generator=g, device="cuda", dtype=torch.bfloat16)
            io = 2 * t * (k + n)
            row = {
                "bench": "op",
                "projection": name,
                "n": n,
                "k": k,
                "per_pass": count,
                "tokens": t,
                "bf16_cublas_ms": ring.ms(lambda w: F.linear(x, w), ring.bf16),
                "bf16_floor_ms": (2 * n * k + io) / bandwidth * 1e3,
                "fp8_floor_ms": (n * k + ring.fp8[0].scale.numel() * 4 + io) / bandwidth * 1e3,
            }
            if t <= 4:
                row["bf16_gemv_ms"] = ring.ms(lambda w: triton_gemv.gemv(x, w), ring.bf16)
                row["fp8_gemv_ms"] = ring.ms(lambda w: triton_gemv.gemv(x, w), ring.fp8)
            if triton_linear.fits_fp8_gemm(x, ring.fp8[0]):
                row["fp8_cublas_ms"] = ring.ms(lambda w: triton_linear.fp8_gemm(x, w), ring.fp8)
            rows.append(row)
    return rows


PASS_KEYS = ("bf16_cublas_ms", "bf16_gemv_ms", "bf16_floor_ms", "fp8_cublas_ms", "fp8_gemv_ms", "fp8_floor_ms")


def pass_rows(ops: list[dict]) -> list[dict]:
    rows = []
    for t in sorted({r["tokens"] for r in ops}):
        mine = [r for r in ops if r["tokens"] == t]
        rows.append(
            {"bench": "pass", "tokens": t}
            | {key: sum(r[key] * r["per_pass"] for r in mine) for key in PASS_KEYS if all(key in r for r in mine)}
        )
    return rows


def sweep_rows(rings: dict, tokens: list[int]) -> list[dict]:
    """Per token count, weights and candidate (tile, programs per SM): the pass sum over the projections."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    tiles = [(4, 256), (8, 256), (8, 512), (16, 256), (16, 512), (32, 256)]
    for t, label, tile, per_sm in itertools.product(tokens, ("bf16", "fp8"), tiles, (1, 2, 4)):
        total = 0.0
        for (_name, n, k, count), ring in rings.items():
            x = torch.randn(t, k, generator=g, device="cuda", dtype=torch.bfloat16)
            c = triton_gemv.gemv_config(t, n, k, x.device, per_sm, tile)
            total += ring.ms(lambda w, c=c: triton_gemv.gemv(x, w, None, c), getattr(ring, label)) * count
        chosen = tile == triton_gemv.GEMV_TILE and per_sm == triton_gemv.GEMV_PROGRAMS_PER_SM
        rows.append(
            {
                "bench": "sweep",
                "tokens": t,
                "weights": label,
                "tile": "/".join(map(str, tile)),
                "per_sm": per_sm,
                "pass_ms": total,
                "chosen": chosen,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-35b-a3b"))
    p.add_argument("--tokens", type=ints, default=[1, 2, 4, 8, 16, 64, 256, 4096])
    p.add_argument("--sweep", action="store_true", help="also time the GEMV's tiles (sets its defaults)")
    p.add_argument("--out", default=str(RESULTS / "gpu_linear.json"))
    args = p.parse_args()
    assert BLOCK == 128
    bandwidth = hbm_bandwidth()
    print(f"measured: HBM copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    cfg = ModelConfig.from_dir(args.model)
    g = torch.Generator(device="cuda").manual_seed(2)
    rings = {proj: Ring(*proj[1:], g) for proj in projections(cfg)}
    ops = op_rows(cfg, rings, args.tokens, bandwidth)
    print_table(
        ops,
        [
            "projection",
            "n",
            "k",
            "tokens",
            "bf16_cublas_ms",
            "bf16_gemv_ms",
            "bf16_floor_ms",
            "fp8_cublas_ms",
            "fp8_gemv_ms",
            "fp8_floor_ms",
        ],
    )
    passes = pass_rows(ops)
    print_table(passes, ["tokens", *PASS_KEYS])
    rows = ops + passes
    if args.sweep:
        sweep = sweep_rows(rings, [t for t in args.tokens if t == triton_linear.GEMV_MAX_TOKENS])
        for t, label in sorted({(r["tokens"], r["weights"]) for r in sweep}):
            mine = sorted((r for r in sweep if (r["tokens"], r["weights"]) == (t, label)), key=lambda r: r["pass_ms"])
            chosen = [r for r in mine if r["chosen"] and r not in mine[:3]]
            print_table(mine[:3] + chosen, ["tokens", "weights", "tile", "per_sm", "pass_ms", "chosen"])
        rows += sweep
    write_result(args.out, {"model": args.model, "rows": rows}, machine_info())
    print("wrote", args.out)


if __name__ == "__main__":
    main()

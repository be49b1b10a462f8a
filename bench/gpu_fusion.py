"""Projections fused with the op before them (kernels/triton_fused_linear.py; issue #43) on one GPU: whole decode
steps with the fusion off (gpu_common.few_token_fusions(False): every op its own kernel, cuBLAS for every plain
projection, as before it) and
on, per model shape, quantization and batch, in one process with the same weights:

- `graph_gpu_ms`: GPU time of the step's CUDA graph replay (CUDA events), host preparation outside it;
- `step_ms`: the engine's step as it runs (prepare, replay, logits, argmax, tokens to the host);
- `launches`: kernels and copies of one eager step under the profiler (what the graph replays);
- `roofline_ms`: the bytes the step must move at the measured copy rate (bench/gpu_moe.py's: MoE layers count the
  experts the step's own routing touches).

After the steps, `op` rows: each fused op at one token against its two kernels unfused, at the model's shapes,
bf16 and FP8 weights: one call's share of a CUDA graph over a ring of distinct weights (bench/gpu_linear.py's
Ring: as many as a forward pass holds, at least enough to exceed the L2 cache), so per op which is faster.
With `--kernels`, every kernel of one fused batch-1 step of each model (bf16), by calls: what is left to fuse.
The units of work (a model's steps in one quantization, a model's ops) run in that order, the 35B-A3B shape's
first; the JSON is rewritten after each, and with `--budget-s` those that no longer fit are skipped (listed in
its `skipped`).

    python bench/gpu_fusion.py --kernels --budget-s 240 --out bench/results/gpu_fusion.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, RESULTS, decode_items, ints, print_table, write_result
from bench.gpu_common import (
    core_for,
    few_token_fusions,
    gpu_ms,
    hbm_bandwidth,
    kernel_breakdown,
    machine_info,
    step_bytes,
    time_ms,
)
from bench.gpu_linear import Ring
from bench.gpu_moe import launches_per_step, touched_expert_bytes
from deltamesh.engine.config import FULL_ATTENTION, ModelConfig
from deltamesh.kernels import triton_fused_linear


def op_rows(model: str) -> list[dict]:
    """Each fused op at one token, fused and unfused, bf16 and FP8 weights (the router stays bf16)."""
    cfg = ModelConfig.from_dir(str(CONFIGS / model))
    g = torch.Generator(device="cuda").manual_seed(0)
    full = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    layers, hidden = len(cfg.layer_types), cfg.hidden_size

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    # the gate and z are views into a wider projection, as the model passes them
    d, dv = cfg.head_dim, cfg.linear_value_head_dim
    attn, gate = r(1, cfg.num_attention_heads, d), r(1, cfg.num_attention_heads, 2 * d)[..., d:]
    core, z = r(1, cfg.linear_num_value_heads, dv), r(1, cfg.linear_num_value_heads, 2 * dv)[..., dv:]
    h, res, norm_w, gated_w = r(1, hidden), r(1, hidden), r(hidden) * 0.1, r(dv) + 1
    first_rows = cfg.num_experts + 1 if cfg.num_experts else 2 * cfg.intermediate_size
    fl = triton_fused_linear
    cases = [  # (op, its call on a weight, weight rows, columns, calls per forward pass)
        ("gate + o_proj", lambda w: fl.gate_linear(attn, gate, w), hidden, attn[0].numel(), full),
        (
            "gated norm + out_proj",
            lambda w: fl.gated_norm_linear(core, z, gated_w, 1e-6, w),
            hidden,
            core[0].numel(),
            layers - full,
        ),
        (
            "post-attention norm + " + ("router" if cfg.num_experts else "gate_up"),
            lambda w: fl.add_rms_norm_linear(h, res, norm_w, 1e-6, w),
            first_rows,
            hidden,
            layers,
        ),
    ]
    rows = []
    for op, call, n, k, per_pass in cases:
        ring = Ring(n, k, per_pass, g)
        for weights in ("bf16", "fp8"):
            if weights == "fp8" and (op.endswith("router") or n % 128):
                continue  # FP8 checkpoints keep the router in bf16
            row = {"bench": "op", "model": model, "op": op, "weights": weights, "per_pass": per_pass}
            for fused in (False, True):
                with few_token_fusions(fused):
                    row["fused_us" if fused else "unfused_us"] = ring.ms(call, getattr(ring, weights)) * 1e3
            row["saved_per_pass_ms"] = (row["unfused_us"] - row["fused_us"]) * per_pass / 1e3
            rows.append(row)
        del ring
    return rows


def step_rows(core, model: str, quantization: str, batches: list[int], context: int, bandwidth: float) -> list[dict]:
    rows = []
    for fused in (False, True):  # read when the graphs are captured
        with few_token_fusions(fused):
            core.runner.capture_decode_graphs(max(batches), context + 64)
            for batch in batches:
                items = decode_items(core, batch, context)
                parts = step_bytes(core, batch, context)
                all_experts, touched = touched_expert_bytes(core, items)
                floor_ms = (parts["weights"] - all_experts + touched + parts["kv"] + parts["state"]) / bandwidth * 1e3
                inputs = core.runner.prepare(items)
                graph = gpu_ms(lambda: core.runner.graphs.run(*inputs))
                rows.append(
                    {
                        "bench": "decode step",
                        "model": model,
                        "quantization": quantization,
                        "batch": batch,
                        "context": context,
                        "fusion": "on" if fused else "off",
                        "graph_gpu_ms": graph,
                        "step_ms": time_ms(lambda: core.runner.execute(items).argmax(-1).tolist()),
                        "launches": launches_per_step(core, items),
                        "roofline_ms": floor_ms,
                        "of_roofline": floor_ms / graph,
                    }
                )
                for it in items:
                    core.scheduler.free(it.request)
    return rows


def before_after(rows: list[dict]) -> list[dict]:
    """One row per model, quantization and batch: off against on."""
    out = []
    for off in (r for r in rows if r["fusion"] == "off"):
        key = (off["model"], off["quantization"], off["batch"])
        on = next(r for r in rows if r["fusion"] == "on" and (r["model"], r["quantization"], r["batch"]) == key)
        out.append(
            {
                "bench": "fusion off -> on",
                "model": off["model"],
                "quantization": off["quantization"],
                "batch": off["batch"],
                "off_ms": off["graph_gpu_ms"],
                "on_ms": on["graph_gpu_ms"],
                "saved_ms": off["graph_gpu_ms"] - on["graph_gpu_ms"],
                "off_launches": off["launches"],
                "on_launches": on["launches"],
                "on_of_roofline": on["of_roofline"],
            }
        )
    return out


def print_kernels(core, model: str, context: int) -> list[dict]:
    items = decode_items(core, 1, context)
    groups, kernels = kernel_breakdown(core, items, steps=1, top=1000)
    for it in items:
        core.scheduler.free(it.request)
    print(f"{model}, batch 1, fused: {sum(k['calls'] for k in kernels)} kernel calls, by group and by kernel")
    print_table(groups, ["group", "kernels", "calls", "ms"])
    print_table(sorted(kernels, key=lambda k: -k["calls"])[:30], ["kernel", "calls", "ms"])
    return [{"bench": "kernels", "model": model, "groups": groups, "kernels": kernels}]


STEP_COLUMNS = ["model", "quantization", "batch", "fusion", "graph_gpu_ms", "step_ms", "launches", "roofline_ms"]
TABLE_COLUMNS = ["model", "quantization", "batch", "off_ms", "on_ms", "saved_ms", "off_launches", "on_launches"]


class Budget:
    """--budget-s: a unit of work starts only while its guess still fits, so that a time-bounded stage ends with
    the finished units written rather than killed in the middle of one."""

    def __init__(self, seconds: float | None):
        self.end = time.monotonic() + seconds if seconds else None

    @staticmethod
    def guess_s(model: str, what: str) -> float:
        """Seconds a unit takes on one H200 from a cold Triton cache (model load, compilation, two graph captures
        of the decode steps), with a margin."""
        return 25 if what == "ops" else 90 if "a3b" in model else 60

    def fits(self, model: str, what: str) -> bool:
        return self.end is None or time.monotonic() + self.guess_s(model, what) <= self.end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3.5-35b-a3b,qwen3.5-9b", help="shapes from bench/configs")
    p.add_argument("--quantization", default="none,fp8", help="none and/or fp8 (the 35B-A3B shape only)")
    p.add_argument("--batches", type=ints, default=[1, 4, 16])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--kernels", action="store_true", help="also list one fused batch-1 step's kernels")
    p.add_argument("--skip-ops", action="store_true", help="whole steps only (no per-op rows)")
    p.add_argument("--budget-s", type=float, help="skip the units of work (in the order run) that no longer fit")
    p.add_argument("--out", default=str(RESULTS / "gpu_fusion.json"))
    args = p.parse_args()
    budget = Budget(args.budget_s)
    bandwidth = hbm_bandwidth()
    print(f"measured: HBM copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    models = args.models.split(",")
    # the whole steps first (the goals), the 35B-A3B shape's first; then each op alone
    units = [(m, q) for m in models for q in args.quantization.split(",") if q == "none" or "a3b" in m]
    units += [] if args.skip_ops else [(m, "ops") for m in models]
    rows, extra, skipped = [], [], []

    def write() -> None:
        payload = {"hbm_copy_bytes_per_s": bandwidth, "rows": rows + before_after(rows) + extra, "skipped": skipped}
        write_result(args.out, payload, machine_info())

    for model, what in units:
        if not budget.fits(model, what):
            skipped.append(f"{model} {what}")
            print(f"skipped {model} {what}: it would not fit in --budget-s {args.budget_s:g}", flush=True)
            continue
        if what == "ops":
            extra += op_rows(model)
            print(f"{model}, one token, µs per call (a ring of weights from HBM), fused against unfused:")
            ops = [r for r in extra if r["bench"] == "op" and r["model"] == model]
            print_table(ops, ["op", "weights", "unfused_us", "fused_us", "per_pass", "saved_per_pass_ms"])
        else:
            core = core_for(str(CONFIGS / model), max(args.batches), args.context, cuda_graphs=False, quantization=what)
            rows += step_rows(core, model, what, args.batches, args.context, bandwidth)
            print_table(rows[-2 * len(args.batches) :], [*STEP_COLUMNS, "of_roofline"])
            if args.kernels and what == "none":
                extra += print_kernels(core, model, args.context)
            del core
            gc.collect()
            torch.cuda.empty_cache()
        write()  # what is finished survives a stage's time bound
    print("decode steps, fusion off -> on (GPU ms of the graph, launches of an eager step):")
    print_table(before_after(rows), [*TABLE_COLUMNS, "on_of_roofline"])
    write()
    print("wrote", args.out, "; skipped:", ", ".join(skipped) or "nothing")


if __name__ == "__main__":
    main()

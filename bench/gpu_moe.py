"""MoE on one GPU, Qwen3.5-35B-A3B shape (dummy weights, bf16): the fused Triton experts against the torch
reference (grouped GEMMs), alone and in whole decode steps, against an honest roofline.

- `op` rows: one MoE layer (routed and shared experts) for T tokens, each implementation replayed from a CUDA
  graph (as a decode step runs them) up to T = 256, eager for prefill sizes; the floor is the bytes it must read
  (the experts the routing touched, the shared expert, x, the output) at the measured HBM copy rate.
- `verify rows`: one request's K+1 = 2..4 verify rows when each keeps part of the previous row's experts (as a
  real router's consecutive tokens do, the dummy one's do not): the pair-wise path against the aligned one.
- `routing` rows: how evenly the dummy router spreads tokens: distinct experts touched per layer against what
  uniform routing would touch, E * (1 - (1 - k/E)^T), and the busiest expert's share of the pairs.
- `decode step` rows: whole steps (CUDA graphs) with each MoE implementation; GPU operations per step (an eager
  step under the profiler); the roofline counts every non-expert weight, the experts the step's own routing
  touches (counted from each layer's router output), KV and GDN state.
- `prefill` rows: one prompt of `--prefill` tokens with each implementation.

`--quantization fp8`: the same with FP8 experts and projections (dummy weights quantized in 128x128 blocks), the
fused Triton experts only (the torch reference dequantizes every expert at every call).

    python bench/gpu_moe.py --out bench/results/gpu_moe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, RESULTS, decode_items, ints, prefill_items, print_table, write_result
from bench.gpu_common import (
    core_for,
    gpu_ms,
    graph_ms,
    hbm_bandwidth,
    kernel_breakdown,
    machine_info,
    profiled_steps,
    step_bytes,
    time_ms,
)
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.models.layers import SparseMoE, linear_weight
from deltamesh.engine.weights import init_dummy
from deltamesh.kernels import torch_ref, triton_linear, triton_moe, triton_moe_aligned, triton_moe_pairs
from deltamesh.kernels.fp8 import Fp8Weight

IMPLS = {"torch": torch_ref.moe, "triton": triton_moe.moe}


def layer_inputs(layer: SparseMoE, tokens: int):
    """(x, router logits, shared gate) for `tokens` random hidden states."""
    x = torch.randn(tokens, layer.w13.shape[2], device="cuda", dtype=torch.bfloat16)
    gates = F.linear(x, layer.gates)
    return x, gates[:, : layer.num_experts], gates[:, layer.num_experts :]


def layer_args(layer: SparseMoE, tokens: int) -> tuple:
    """kernels.moe's arguments for `tokens` random hidden states."""
    x, logits, gate = layer_inputs(layer, tokens)
    return (
        x,
        logits,
        linear_weight(layer, "w13"),
        linear_weight(layer, "w2"),
        layer.top_k,
        layer.norm_topk,
        linear_weight(layer.shared, "gate_up"),
        linear_weight(layer.shared, "down"),
        gate,
    )


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_bytes(w13, w2) -> int:
    """Bytes of one expert's weights (with its block scales when FP8)."""
    if isinstance(w13, Fp8Weight):
        return nbytes(w13.weight[0], w13.scale[0], w2.weight[0], w2.scale[0])
    return nbytes(w13[0], w2[0])


def op_rows(layer: SparseMoE, tokens: list[int], bandwidth: float, impls_: dict) -> list[dict]:
    """The whole layer (routed and shared experts) per implementation; up to 32 tokens also both Triton paths
    forced (pairs: every pair reads its expert; aligned: pairs grouped by expert), which sets DECODE_MAX_TOKENS."""
    rows = []
    per_expert = expert_bytes(linear_weight(layer, "w13"), linear_weight(layer, "w2"))
    shared_bytes = nbytes(*(p for n, p in layer.shared.named_parameters()))
    for t in tokens:
        args = layer_args(layer, t)
        x, logits = args[0], args[1]
        touched = torch.topk(logits.float(), layer.top_k, dim=-1).indices.unique().numel()
        floor_ms = (touched * per_expert + shared_bytes + 2 * x.numel() * x.element_size()) / bandwidth * 1e3
        row = {"bench": "op", "tokens": t, "experts_touched": touched, "floor_ms": floor_ms}
        impls = dict(impls_)
        if t <= 32:
            impls["pairs"] = triton_moe_pairs.moe_pairs
            impls["aligned"] = lambda *a: triton_moe.moe(*a, config=triton_moe_aligned.gemm_config(t * layer.top_k))
        for name, impl in impls.items():
            row[f"{name}_ms"] = graph_ms(lambda: impl(*args)) if t <= 256 else gpu_ms(lambda: impl(*args))
        if "torch_ms" in row:
            row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["triton_of_floor"] = floor_ms / row["triton_ms"]
        rows.append(row)
    return rows


def overlapping_logits(tokens: int, experts: int, top_k: int, shared: int, generator: torch.Generator) -> torch.Tensor:
    """Router logits [tokens, experts] whose top-k choices keep `shared` of the previous token's experts per row
    (the rest new, drawn at random): consecutive tokens of one request, as a verify step's K+1 rows are, which a
    real router sends to overlapping experts and the dummy one does not."""
    chosen = [torch.randperm(experts, generator=generator)[:top_k]]
    for _ in range(1, tokens):
        kept = chosen[-1][torch.randperm(top_k, generator=generator)[:shared]]
        others = torch.ones(experts, dtype=torch.bool)
        others[chosen[-1]] = False
        pool = others.nonzero().flatten()
        new = pool[torch.randperm(len(pool), generator=generator)[: top_k - shared]]
        chosen.append(torch.cat([kept, new]))
    logits = torch.rand(tokens, experts, generator=generator) - 2  # below every chosen expert's
    for row, picks in enumerate(chosen):
        logits[row, picks] = torch.rand(top_k, generator=generator) + 1
    return logits


def verify_rows(layer: SparseMoE, bandwidth: float) -> list[dict]:
    """One request's verify step through the MoE layer (K+1 = 2..4 rows, the pair-wise path's range) when each row
    keeps 0, half or three quarters of the previous row's experts: the pair-wise path (every pair reads its
    expert) against the aligned one (each expert read once), with the floor of the experts touched. What a real
    checkpoint's routing would make of DECODE_MAX_TOKENS for verify steps (#42); the dummy router shares none."""
    rows = []
    per_expert = expert_bytes(linear_weight(layer, "w13"), linear_weight(layer, "w2"))
    shared_bytes = nbytes(*(p for n, p in layer.shared.named_parameters()))
    g = torch.Generator().manual_seed(0)
    for t in (2, 3, 4):
        for kept in sorted({0, layer.top_k // 2, 3 * layer.top_k // 4}):
            args = list(layer_args(layer, t))
            logits = overlapping_logits(t, layer.num_experts, layer.top_k, kept, g)
            args[1] = logits.to(device=args[1].device, dtype=args[1].dtype)
            touched = torch.topk(args[1].float(), layer.top_k, dim=-1).indices.unique().numel()
            floor_ms = (touched * per_expert + shared_bytes + 2 * args[0].numel() * 2) / bandwidth * 1e3
            aligned = triton_moe_aligned.gemm_config(t * layer.top_k)
            row = {"bench": "verify rows", "tokens": t, "kept_of_previous": kept, "experts_touched": touched}
            row["floor_ms"] = floor_ms
            row["pairs_ms"] = graph_ms(lambda: triton_moe_pairs.moe_pairs(*args))
            row["aligned_ms"] = graph_ms(lambda: triton_moe.moe(*args, config=aligned))
            rows.append(row)
    return rows


SWEEP = [
    (16, 64, 64, 4, 3),
    (16, 128, 64, 4, 3),
    (16, 64, 128, 4, 4),
    (32, 64, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 32, 4, 4),
]


def sweep_rows(layer: SparseMoE, tokens: list[int]) -> list[dict]:
    """The fused kernels' time per block configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    rows = []
    for t in tokens:
        args = layer_args(layer, t)
        for cfg in map(lambda c: triton_moe_aligned.GemmConfig(*c), SWEEP):

            def fn(cfg=cfg):
                return triton_moe.moe(*args, config=cfg)

            rows.append(
                {
                    "bench": "sweep",
                    "tokens": t,
                    "config": "/".join(map(str, cfg)),
                    "ms": graph_ms(fn) if t <= 256 else gpu_ms(fn),
                    "chosen": cfg == triton_moe_aligned.gemm_config(t * layer.top_k),
                }
            )
    return rows


# Candidate tiles of each pair-wise kernel (rows per program, K step, warps), at most 64 float32 sums per thread
GATE_UP_TILES = [
    triton_moe_pairs.PairTile(n, k, w)
    for n in (2, 4, 8)
    for k in (512, 1024, 2048)
    for w in (1, 2, 4)
    if n * k <= 2048 * w
]
DOWN_TILES = [triton_moe_pairs.PairTile(n, 512, w) for n in (2, 4, 8, 16) for w in (1, 2, 4) if n * 512 <= 2048 * w]
RING = 40  # calls per timed graph: a step's MoE layers


def _copy(w):
    return Fp8Weight(w.weight.clone(), w.scale.clone()) if isinstance(w, Fp8Weight) else w.clone()


def pair_sweep_rows(layer: SparseMoE, tokens: list[int]) -> list[dict]:
    """The pair-wise path per tile, up to DECODE_MAX_TOKENS: each gate/up tile with the chosen down tile, and each
    down tile with the chosen gate/up tile (the kernels run one after the other and do not share work). Time: one
    call's share of a graph of RING calls, each with its own inputs (so its own routed experts) and its own copy
    of the shared expert, so that the weights come from HBM as in a step, not from the L2 cache."""
    rows = []
    for t in [t for t in tokens if t <= triton_moe.DECODE_MAX_TOKENS]:
        calls = []
        for _ in range(RING):
            args = list(layer_args(layer, t))
            args[6], args[7] = _copy(args[6]), _copy(args[7])
            calls.append(args)
        chosen = triton_moe_pairs.pair_config(t)
        configs = [chosen._replace(gate_up=g) for g in GATE_UP_TILES] + [chosen._replace(down=d) for d in DOWN_TILES]
        for cfg in dict.fromkeys(configs):

            def ring(cfg=cfg):
                for args in calls:
                    triton_moe_pairs.moe_pairs(*args, tiles=cfg)

            rows.append(
                {
                    "bench": "pair_sweep",
                    "tokens": t,
                    "gate_up": "/".join(map(str, cfg.gate_up)),
                    "down": "/".join(map(str, cfg.down)),
                    "ms": graph_ms(ring) / RING,
                    "chosen": cfg == chosen,
                }
            )
    return rows


def routing_rows(layer: SparseMoE, batches: list[int]) -> list[dict]:
    """Distinct experts touched and the busiest expert's share of the (token, choice) pairs, for batches of
    random hidden states through a dummy-initialised router."""
    rows = []
    e, k = layer.num_experts, layer.top_k
    for t in batches:
        x = torch.randn(t, layer.w13.shape[2], device="cuda", dtype=torch.bfloat16)
        ids = torch.topk(F.linear(x, layer.router).float(), k, dim=-1).indices.flatten()
        rows.append(
            {
                "bench": "routing",
                "tokens": t,
                "experts_touched": ids.unique().numel(),
                "uniform_expectation": e * (1 - (1 - k / e) ** t),
                "busiest_expert_share": torch.bincount(ids, minlength=e).max().item() / ids.numel(),
                "uniform_share": k / e,
            }
        )
    return rows


def dummy_layer(model_dir: str, fp8: bool) -> SparseMoE:
    """One MoE layer of the model, with the dummy loader's weights."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = SparseMoE(ModelConfig.from_dir(model_dir), fp8)
    finally:
        torch.set_default_dtype(prev)
    init_dummy(layer, seed=0)
    return layer


def launches_per_step(core, items) -> int:
    prof = profiled_steps(core, items, steps=1)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def touched_expert_bytes(core, items) -> tuple[int, int]:
    """(bytes of every expert weight, bytes of the experts the step's own routing touches), counted in an eager
    step of `items` with each MoE layer's router output."""
    r = core.runner
    impl, layers = r.kernels.moe, []

    def counting(x, logits, w13, w2, top_k, norm_topk, *shared, **kw):
        per_expert = expert_bytes(w13, w2)
        used = torch.topk(logits.float(), top_k, dim=-1).indices.unique().numel()
        layers.append((logits.shape[1] * per_expert, used * per_expert))
        return impl(x, logits, w13, w2, top_k, norm_topk, *shared, **kw)

    r.kernels.moe = counting
    try:
        input_ids, batch = r.prepare(items)
        with torch.inference_mode():
            r.model(input_ids, batch, r.kv_pool, r.state_pool, r.kernels)
    finally:
        r.kernels.moe = impl
    return sum(t for t, _ in layers), sum(u for _, u in layers)


def decode_rows(core, batches: list[int], context: int, bandwidth: float, impls: dict) -> list[dict]:
    rows = []
    for batch in batches:
        items = decode_items(core, batch, context)
        parts = step_bytes(core, batch, context)
        all_experts, touched = touched_expert_bytes(core, items)
        honest = parts["weights"] - all_experts + touched + parts["kv"] + parts["state"]
        for name, impl in impls.items():
            core.runner.kernels.moe = impl
            core.runner.capture_decode_graphs(max(batches), context + 64)
            inputs = core.runner.prepare(items)
            ms = gpu_ms(lambda: core.runner.graphs.run(*inputs))
            step_ms = time_ms(lambda: core.runner.execute(items).argmax(-1).tolist())
            rows.append(
                {
                    "bench": "decode step",
                    "moe": name,
                    "batch": batch,
                    "context": context,
                    "graph_gpu_ms": ms,
                    "step_ms": step_ms,
                    "launches": launches_per_step(core, items),
                    "experts_touched_share": touched / all_experts,
                    "roofline_ms": honest / bandwidth * 1e3,
                    "of_roofline": honest / bandwidth * 1e3 / ms,
                    "all_experts_roofline_ms": sum(parts.values()) / bandwidth * 1e3,
                }
            )
        for it in items:
            core.scheduler.free(it.request)
    return rows


def print_step_kernels(core, batches: list[int], context: int) -> None:
    core.runner.kernels.moe = IMPLS["triton"]
    for batch in batches:
        items = decode_items(core, batch, context)
        groups, kernels = kernel_breakdown(core, items, steps=1, top=1000)
        print(
            f"decode step, batch {batch}: {sum(k['calls'] for k in kernels)} kernel calls, "
            f"{sum(k['ms'] for k in kernels):.2f} ms of kernel time"
        )
        print_table(groups, ["group", "kernels", "calls", "ms"])
        print_table(sorted(kernels, key=lambda k: -k["calls"]), ["kernel", "calls", "ms"])
        for it in items:
            core.scheduler.free(it.request)


def prefill_rows(core, tokens: int, profile: bool, impls: dict) -> list[dict]:
    rows = []
    for name, impl in impls.items():
        core.runner.kernels.moe = impl
        items = prefill_items(core, 1, tokens)
        row = {
            "bench": "prefill",
            "moe": name,
            "tokens": tokens,
            "ms": time_ms(lambda: core.runner.execute(items).argmax(-1).tolist(), iters=5),
        }
        if profile and name == "triton":
            groups, top = kernel_breakdown(core, items, steps=1)
            print(f"kernel time of one {tokens}-token prefill (sum {sum(g['ms'] for g in groups):.1f} ms):")
            print_table(groups, ["group", "kernels", "calls", "ms"])
            print_table(top[:15], ["kernel", "calls", "ms"])
            row |= {"kernel_groups": groups, "top_kernels": top}
        core.scheduler.free(items[0].request)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-35b-a3b"))
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--op-tokens", type=ints, default=[1, 16, 64, 256, 8192])
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--skip-steps", action="store_true", help="the op and routing rows only")
    p.add_argument("--sweep", action="store_true", help="also time the fused kernels' block configurations")
    p.add_argument("--profile", action="store_true", help="print where the prefill's GPU time goes")
    p.add_argument(
        "--step-kernels",
        action="store_true",
        help="print every kernel of one eager decode step (fused MoE) at each batch, with its calls",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "fp8"],
        default="none",
        help="fp8: FP8 experts and projections (dummy weights quantized in blocks)",
    )
    p.add_argument("--moe", default="torch,triton", help="the MoE implementations to time, of torch and triton")
    p.add_argument(
        "--gemv-max-tokens",
        type=ints,
        default=[triton_linear.GEMV_MAX_TOKENS],
        help="decode steps with the FP8 layers' GEMV up to each of these token counts (0: cuBLAS)",
    )
    p.add_argument("--out", default=str(RESULTS / "gpu_moe.json"))
    args = p.parse_args()
    fp8 = args.quantization == "fp8"
    impls = {name: IMPLS[name] for name in args.moe.split(",") if not (fp8 and name == "torch")}
    bandwidth = hbm_bandwidth()
    print(f"measured: HBM copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    layer = dummy_layer(args.model, fp8)
    rows = op_rows(layer, args.op_tokens, bandwidth, impls)
    print_table(
        rows,
        [
            "tokens",
            "experts_touched",
            "floor_ms",
            "torch_ms",
            "triton_ms",
            "pairs_ms",
            "aligned_ms",
            "speedup",
            "triton_of_floor",
        ],
    )
    verify = verify_rows(layer, bandwidth)
    print_table(verify, ["tokens", "kept_of_previous", "experts_touched", "floor_ms", "pairs_ms", "aligned_ms"])
    rows += verify
    routing = routing_rows(layer, [1, 16, 64, 256, 8192])
    print_table(routing, ["tokens", "experts_touched", "uniform_expectation", "busiest_expert_share", "uniform_share"])
    rows += routing
    if args.sweep:
        sweep = sweep_rows(layer, args.op_tokens)
        print_table(sweep, ["tokens", "config", "ms", "chosen"])
        pair_sweep = pair_sweep_rows(layer, args.op_tokens)
        for t in sorted({r["tokens"] for r in pair_sweep}):  # the five fastest tiles per batch, and the chosen
            mine = sorted((r for r in pair_sweep if r["tokens"] == t), key=lambda r: r["ms"])
            print_table(mine[:5] + [r for r in mine[5:] if r["chosen"]], ["tokens", "gate_up", "down", "ms", "chosen"])
        rows += sweep + pair_sweep
    del layer
    if not args.skip_steps:
        core = core_for(
            args.model,
            max(args.batches),
            max(args.context, args.prefill),
            cuda_graphs=False,
            quantization=args.quantization,
        )
        if args.step_kernels:
            print_step_kernels(core, args.batches, args.context)
        steps, default_gemv = [], triton_linear.GEMV_MAX_TOKENS
        for gemv in args.gemv_max_tokens:  # read when the linear layers are called, so when graphs are captured
            triton_linear.GEMV_MAX_TOKENS = gemv
            steps += [
                r | {"gemv_max_tokens": gemv} for r in decode_rows(core, args.batches, args.context, bandwidth, impls)
            ]
        triton_linear.GEMV_MAX_TOKENS = default_gemv
        print_table(
            steps,
            [
                "moe",
                "gemv_max_tokens",
                "batch",
                "graph_gpu_ms",
                "step_ms",
                "launches",
                "experts_touched_share",
                "roofline_ms",
                "of_roofline",
                "all_experts_roofline_ms",
            ],
        )
        prefill = prefill_rows(core, args.prefill, args.profile, impls)
        print_table(prefill, ["moe", "tokens", "ms"])
        rows += steps + prefill
    write_result(
        args.out, {"hbm_copy_bytes_per_s": bandwidth, "quantization": args.quantization, "rows": rows}, machine_info()
    )


if __name__ == "__main__":
    main()

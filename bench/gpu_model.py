"""Whole-model figures on one GPU, dummy weights at real shapes (bf16):

- decode step of a Qwen3.5-9B-shaped model at batch 64 and 256 with ~9k tokens of context each, against the
  HBM roofline (weights + KV + GDN state bytes one step must move), CUDA graphs on;
- prefill of an 8192-token prompt: model FLOP utilisation against the measured bf16 matmul rate;
- the same model in transformers (`Qwen3_5ForCausalLM`, same weights) generating at the same batch and lengths:
  throughput ratio;
- a Qwen3.5-35B-A3B-shaped (MoE) model: decode step time at batch 64.

    python bench/gpu_model.py --out bench/results/gpu_model.json [--skip-hf] [--skip-moe]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import decode_items  # noqa: E402
from bench.gpu_common import hbm_bandwidth, machine_info, matmul_rate, print_table  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.scheduler import ScheduledItem  # noqa: E402


def core_for(config_dir: str, max_seqs: int, context: int, extra_tokens: int = 64, **kw) -> EngineCore:
    pages = max_seqs * (-(-(context + extra_tokens) // 16)) + 64
    return EngineCore(EngineConfig(
        model=config_dir, load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=max_seqs,
        num_kv_pages=pages, max_model_len=context + extra_tokens, max_num_batched_tokens=max(8192, context), **kw,
    ))  # fmt: skip


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() (it synchronises on its own) after warm-up calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def step_bytes(core: EngineCore, batch: int, context: int) -> dict[str, int]:
    """Bytes a decode step must move: every weight but the embedding table (a step reads `batch` rows of it),
    every request's KV, its GDN state read and written."""
    m = core.model
    weights = sum(p.numel() * p.element_size() for p in m.parameters() if p is not m.embed or m.lm_head is m.embed)
    weights += batch * m.embed.shape[1] * m.embed.element_size()
    kv_per_token = core.kv_pool.page_bytes // core.kv_pool.page_size
    state = core.state_pool.slot_bytes
    return {"weights": weights, "kv": batch * context * kv_per_token, "state": 2 * batch * state}


def gpu_ms(fn, iters: int = 20) -> float:
    """Median GPU time of fn() between CUDA events, after a warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


KERNEL_GROUPS = [  # (group, regex over CUDA kernel names), first match wins
    ("fused MoE (Triton)", r"^_route|^_align|^_scatter|^_gate_up_silu|^_down"),
    ("GDN recurrence", r"gdn|gated_delta|delta_rule|recurrent|gates"),
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|grouped_mm"),
    ("paged attention", r"decode_split|merge_splits"),
    ("attention inputs / gate", r"attention_inputs|sigmoid_gate"),
    ("conv1d", r"conv1d"),
    ("norms", r"rms_norm"),
    ("silu*mul", r"silu_mul"),
    ("kv write / index", r"index|scatter|gather"),
    ("copies", r"copy|memcpy|memset|cat"),
]


def profiled_steps(core: EngineCore, items, steps: int):
    """The torch profiler's record (CUDA activity) of `steps` eager steps of `items`, after one warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    r = core.runner
    input_ids, batch = r.prepare(items)

    def step():
        with torch.inference_mode():
            r.model.logits(r.model(input_ids, batch, r.kv_pool, r.state_pool, r.kernels))

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_breakdown(core: EngineCore, items, steps: int = 3) -> tuple[list[dict], list[dict]]:
    """CUDA time per kernel of eager decode steps (the kernels a graph replays), grouped by KERNEL_GROUPS."""
    import re

    prof = profiled_steps(core, items, steps)
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            kernels.append({"kernel": e.key[:90], "calls": e.count // steps, "ms": us / steps / 1e3})
    kernels.sort(key=lambda k: -k["ms"])
    groups: dict[str, dict] = {}
    for k in kernels:
        name = next((g for g, rx in KERNEL_GROUPS if re.search(rx, k["kernel"], re.I)), "other elementwise")
        grp = groups.setdefault(name, {"group": name, "kernels": 0, "calls": 0, "ms": 0.0})
        grp["kernels"] += 1
        grp["calls"] += k["calls"]
        grp["ms"] += k["ms"]
    return sorted(groups.values(), key=lambda g: -g["ms"]), kernels[:25]


def decode_rows(config_dir: str, batches: list[int], context: int, bandwidth: float, profile: bool = False) -> list[dict]:
    core = core_for(config_dir, max(batches), context)
    rows = []
    for batch in batches:
        items = decode_items(core, batch, context)
        ms = time_ms(lambda: core.runner.execute(items).argmax(-1).tolist())
        prepare_ms = time_ms(lambda: core.runner.prepare(items))
        graph_ms = None
        if core.runner.graphs is not None:
            inputs = core.runner.prepare(items)  # host work stays outside the timed window
            graph_ms = gpu_ms(lambda: core.runner.graphs.run(*inputs))
        parts = step_bytes(core, batch, context)
        roofline_ms = sum(parts.values()) / bandwidth * 1e3
        row = {"bench": "decode step", "model": Path(config_dir).name, "batch": batch, "context": context,
               "ms": ms, "host_prepare_ms": prepare_ms, "graph_gpu_ms": graph_ms, "roofline_ms": roofline_ms,
               "of_roofline": roofline_ms / ms, "tokens_per_s": batch / ms * 1e3, "bytes": parts,
               "graphs": core.runner.graphs is not None}  # fmt: skip
        if profile:
            groups, top = kernel_breakdown(core, items)
            print(f"kernel time per eager decode step, batch {batch} (sum {sum(g['ms'] for g in groups):.2f} ms):")
            print_table(groups, ["group", "kernels", "calls", "ms"])
            print_table(top, ["kernel", "calls", "ms"])
            row |= {"kernel_groups": groups, "top_kernels": top}
        rows.append(row)
        for it in items:
            core.scheduler.free(it.request)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def prefill_flops(core: EngineCore, tokens: int) -> float:
    """Matmul FLOPs of one prompt: every weight but the embedding and LM head once per token, the LM head
    once (only the last position is sampled), causal attention; the GDN recurrence is left out (conservative)."""
    mc = core.model_config
    head = mc.vocab_size * mc.hidden_size
    body = sum(p.numel() for n, p in core.model.named_parameters() if n not in ("embed", "lm_head"))
    attn = 2 * 2 * len(mc.full_layers) * mc.num_attention_heads * mc.head_dim * tokens * tokens / 2  # QK^T, PV
    return 2 * body * tokens + 2 * head + attn


def prefill_row(config_dir: str, tokens: int, peak: float) -> dict:
    core = core_for(config_dir, 2, tokens)

    def run():
        req = Request("p", list(range(3, tokens + 3)), SamplingParams(max_tokens=1, temperature=0), None)
        req.slot, req.pages = core.state_pool.alloc(), core.kv_pool.alloc(core.kv_pool.pages_for(tokens))
        try:
            core.runner.execute([ScheduledItem(req, tokens)]).argmax(-1).tolist()
        finally:
            core.scheduler.free(req)

    ms = time_ms(run, iters=5)
    flops = prefill_flops(core, tokens)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return {"bench": "prefill", "model": Path(config_dir).name, "tokens": tokens, "ms": ms,
            "tflops": flops / ms / 1e9, "mfu": flops / (ms / 1e3) / peak, "tokens_per_s": tokens / ms * 1e3}  # fmt: skip


def hf_vs_engine(config_dir: str, batch: int, prompt: int, new: int) -> dict:
    """transformers' own model vs this engine, same weights, batch of prompts, greedy, fixed lengths."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.weights import load_tensors

    hf_cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda")

    def hf_run():
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    hf_ms = time_ms(hf_run, iters=1, warmup=1)
    core = core_for(config_dir, batch, prompt, extra_tokens=new + 16)
    load_tensors(core.model, hf.state_dict().items())
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    def engine_run():
        reqs = [core.make_request(row.tolist(), params, f"r{i}") for i, row in enumerate(ids)]
        done = []
        for r in reqs:
            core.submit(r, lambda out: done.append(out) if out.finished else None)
        while len(done) < batch:
            core.dispatch(core.process_commands())
            core.dispatch(core.step())

    engine_ms = time_ms(engine_run, iters=1, warmup=1)
    tokens = batch * new
    return {"bench": "transformers vs engine", "model": Path(config_dir).name, "batch": batch, "prompt": prompt,
            "new_tokens": new, "hf_tokens_per_s": tokens / hf_ms * 1e3, "engine_tokens_per_s": tokens / engine_ms * 1e3,
            "ratio": hf_ms / engine_ms}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", default=str(ROOT / "bench/configs/qwen3.5-9b"))
    p.add_argument("--moe", default=str(ROOT / "bench/configs/qwen3.5-35b-a3b"))
    p.add_argument("--context", type=int, default=9216)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--only-moe", action="store_true")
    p.add_argument("--only-decode", action="store_true", help="the dense decode rows only")
    p.add_argument("--profile", action="store_true", help="print a per-kernel breakdown of each decode step")
    p.add_argument("--out", default="bench/results/gpu_model.json")
    args = p.parse_args()
    bandwidth, peak = hbm_bandwidth(), matmul_rate()
    print(f"measured: HBM copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    if args.only_moe:
        args.skip_hf = True
    else:
        rows += decode_rows(args.dense, [64, 256], args.context, bandwidth, args.profile)
        print_table(rows, ["bench", "model", "batch", "context", "ms", "host_prepare_ms", "graph_gpu_ms", "roofline_ms",
                           "of_roofline", "tokens_per_s"])  # fmt: skip
        if args.only_decode:
            args.skip_hf = args.skip_moe = True
        else:
            rows.append(prefill_row(args.dense, 8192, peak))
            print_table(rows[-1:], ["bench", "model", "tokens", "ms", "tflops", "mfu", "tokens_per_s"])
    if not args.skip_hf:
        rows.append(hf_vs_engine(args.dense, 64, 1024, 128))
        print_table(rows[-1:], ["bench", "batch", "prompt", "new_tokens", "hf_tokens_per_s", "engine_tokens_per_s", "ratio"])
    if not args.skip_moe:
        rows += decode_rows(args.moe, [64], 2048, bandwidth)
        print_table(rows[-1:], ["bench", "model", "batch", "context", "ms", "roofline_ms", "of_roofline", "tokens_per_s"])
    out = {"command": " ".join(sys.argv), "machine": machine_info(), "hbm_copy_bytes_per_s": bandwidth,
           "bf16_matmul_flops": peak, "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()

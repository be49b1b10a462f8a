"""Whole-model figures on one GPU, dummy weights at real shapes (bf16):

- decode step of a Qwen3.5-9B-shaped model at batch 64 and 256 with ~9k tokens of context each, against the
  HBM roofline (weights + KV + GDN state bytes one step must move), CUDA graphs on;
- prefill of an 8192-token prompt: model FLOP utilisation against the measured bf16 matmul rate;
- the same model in transformers (`Qwen3_5ForCausalLM`, same weights) generating at the same batch and lengths:
  throughput ratio;
- a Qwen3.5-35B-A3B-shaped (MoE) model: decode step time at batch 64;
- `--mixed`: what a serving step at high concurrency runs, prompts' prefill chunks beside a decode batch
  (`--mixed-prefill`, `--mixed-decodes` at `--context`), eager, against the same prefill alone and the decode
  batch alone; with `--profile`, the kernel groups of the prefill alone and of the mixed step;
- `--host-profile`: the host's side of a step of a 16-token and of a 1024-token prefill (a prompt's last tokens, a
  short prompt), eager and from piecewise CUDA graphs, timed and under cProfile: where the Python time that
  launching ~2,000 kernels costs goes, and what the graphs leave of it (`--dense`, `--moe` shapes);
- `--burst`: 64 prompts of 1024 tokens arriving at once (a serving point's first wave) through the engine's loop:
  each step's wall time and prompt tokens, and when the prompts' first tokens came;
- `--ttft`: one prompt (`--ttft-tokens`) alone through the engine's own loop (submit, steps, first token), prefix
  cache on and off, each step's wall time: what the engine adds to the bare prefill before the first token.

    python bench/gpu_model.py --out bench/results/gpu_model.json [--skip-hf] [--skip-moe]
    python bench/gpu_model.py --mixed --profile --out bench/results/gpu_mixed.json    # the mixed-step rows only
    python bench/gpu_model.py --ttft --out bench/results/gpu_ttft.json                # 9B and 35B-A3B shapes
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    CONFIGS,
    RESULTS,
    decode_items,
    ints,
    median,
    prefill_items,
    print_table,
    write_result,
)
from bench.gpu_common import (
    core_for,
    gpu_ms,
    hbm_bandwidth,
    kernel_breakdown,
    machine_info,
    matmul_rate,
    step_bytes,
    time_ms,
)
from deltamesh.engine import SamplingParams


def decode_rows(
    config_dir: str, batches: list[int], context: int, bandwidth: float, profile: bool = False
) -> list[dict]:
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
        row = {
            "bench": "decode step",
            "model": Path(config_dir).name,
            "batch": batch,
            "context": context,
            "ms": ms,
            "host_prepare_ms": prepare_ms,
            "graph_gpu_ms": graph_ms,
            "roofline_ms": roofline_ms,
            "of_roofline": roofline_ms / ms,
            "tokens_per_s": batch / ms * 1e3,
            "bytes": parts,
            "graphs": core.runner.graphs is not None,
        }
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


def prefill_flops(core, tokens: int) -> float:
    """Matmul FLOPs of one prompt: every weight but the embedding and LM head once per token, the LM head
    once (only the last position is sampled), causal attention; the GDN recurrence is left out (conservative)."""
    mc = core.model_config
    head = mc.vocab_size * mc.hidden_size
    body = sum(p.numel() for n, p in core.model.named_parameters() if n not in ("embed", "lm_head"))
    attn = 2 * 2 * len(mc.full_layers) * mc.num_attention_heads * mc.head_dim * tokens * tokens / 2  # QK^T, PV
    return 2 * body * tokens + 2 * head + attn


def prefill_row(config_dir: str, tokens: int, peak: float) -> dict:
    core = core_for(config_dir, 2, tokens)
    items = prefill_items(core, 1, tokens)
    ms = time_ms(lambda: core.runner.execute(items).argmax(-1).tolist(), iters=5)
    core.scheduler.free(items[0].request)
    flops = prefill_flops(core, tokens)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "bench": "prefill",
        "model": Path(config_dir).name,
        "tokens": tokens,
        "ms": ms,
        "tflops": flops / ms / 1e9,
        "mfu": flops / (ms / 1e3) / peak,
        "tokens_per_s": tokens / ms * 1e3,
    }


def mixed_rows(
    config_dir: str, prompts: int, chunk: int, decodes: int, context: int, profile: bool = False
) -> list[dict]:
    """One eager step of `prompts` prefill chunks of `chunk` tokens after `decodes` decode items at `context`
    (the order the scheduler gives them), against the chunks alone and the decodes alone (a decode-only step
    replays its CUDA graph where one fits, as in serving). `extra_ms` is what the mixed step costs beyond the
    two alone."""
    core = core_for(
        config_dir, decodes + prompts, max(context, chunk), max_num_batched_tokens=prompts * chunk + decodes
    )
    dec, pre = decode_items(core, decodes, context), prefill_items(core, prompts, chunk)
    timed = {
        name: time_ms(lambda its=its: core.runner.execute(its).argmax(-1).tolist(), iters=5)
        for name, its in (("prefill", pre), ("decode", dec), ("mixed", dec + pre))
    }
    row = {
        "bench": "mixed step",
        "model": Path(config_dir).name,
        "prompts": prompts,
        "chunk": chunk,
        "decodes": decodes,
        "context": context,
        "prefill_ms": timed["prefill"],
        "decode_ms": timed["decode"],
        "mixed_ms": timed["mixed"],
        "extra_ms": timed["mixed"] - timed["prefill"] - timed["decode"],
        "prefill_tokens_per_s_mixed": prompts * chunk / timed["mixed"] * 1e3,
    }
    if profile:
        for name, its in (("prefill alone", pre), ("mixed step", dec + pre)):
            groups, top = kernel_breakdown(core, its, steps=2)
            print(f"kernel time, {name} (sum {sum(g['ms'] for g in groups):.1f} ms):")
            print_table(groups, ["group", "kernels", "calls", "ms"])
            print_table(top[:12], ["kernel", "calls", "ms"])
            row[f"kernel_groups_{name.split()[0]}"] = groups
    for it in dec + pre:
        core.scheduler.free(it.request)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return [row]


def ttft_rows(config_dir: str, tokens: int, repeats: int = 3) -> list[dict]:
    """A lone `tokens`-token prompt from submit to its first token through EngineCore.step (as a worker runs it),
    prefix cache on and off; distinct prompts, so nothing starts from the cache. Per row: the median time to
    the first token, the steps it took and their wall times (the step that returns the token included)."""
    import time

    rows = []
    for cache in (True, False):
        core = core_for(config_dir, 2, tokens, prefix_cache=cache, max_num_batched_tokens=max(16384, tokens))
        vocab = core.model_config.vocab_size
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        runs = []
        for r in range(repeats + 1):  # the first is a warm-up
            prompt = [3 + (7919 * r + 31 * j) % (vocab - 3) for j in range(tokens)]
            first: list[float] = []
            core.submit(
                core.make_request(prompt, params, f"t{r}"),
                lambda out: first.append(time.perf_counter()) if not first else None,
            )
            start, steps = time.perf_counter(), []
            core.dispatch(core.process_commands())
            while not first:
                t = time.perf_counter()
                core.dispatch(core.step())
                steps.append((time.perf_counter() - t) * 1e3)
            runs.append({"ttft_ms": (first[0] - start) * 1e3, "step_ms": [round(x, 2) for x in steps]})
            while core.has_work:
                core.dispatch(core.step())
        runs = sorted(runs[1:], key=lambda x: x["ttft_ms"])
        mid = runs[len(runs) // 2]
        rows.append(
            {
                "bench": "ttft",
                "model": Path(config_dir).name,
                "tokens": tokens,
                "prefix_cache": cache,
                "ttft_ms": mid["ttft_ms"],
                "steps": len(mid["step_ms"]),
                "step_ms": mid["step_ms"],
            }
        )
        del core
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def burst_rows(config_dir: str, prompts: int = 64, tokens: int = 1024, budget: int = 16384) -> list[dict]:
    """`prompts` prompts of `tokens` arriving at once (a serving point's first wave), through EngineCore.step with
    the prefix cache on, as a worker runs them: each step's wall time and prompt tokens, and when each prompt's
    first token came. Two bursts of distinct prompts: the first meets every step shape for the first time."""
    import time

    core = core_for(config_dir, prompts, tokens, extra_tokens=80, prefix_cache=True, max_num_batched_tokens=budget)
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    rows = []
    for burst in range(2):
        first: dict[str, float] = {}
        for i in range(prompts):
            prompt = [3 + (7919 * (burst * prompts + i) + 31 * j) % (vocab - 3) for j in range(tokens)]
            rid = f"b{burst}r{i}"
            core.submit(
                core.make_request(prompt, params, rid), lambda out, rid=rid: first.setdefault(rid, time.perf_counter())
            )
        start, steps = time.perf_counter(), []
        core.dispatch(core.process_commands())
        while len(first) < prompts:
            t, before = time.perf_counter(), core.stats.prompt_tokens
            core.dispatch(core.step())
            steps.append((round((time.perf_counter() - t) * 1e3, 1), core.stats.prompt_tokens - before))
        while core.has_work:
            core.dispatch(core.step())
        ttfts = sorted((f - start) * 1e3 for f in first.values())
        rows.append(
            {
                "bench": "burst",
                "model": Path(config_dir).name,
                "burst": burst,
                "prompts": prompts,
                "tokens": tokens,
                "ttft_min_ms": ttfts[0],
                "ttft_median_ms": ttfts[len(ttfts) // 2],
                "ttft_max_ms": ttfts[-1],
                "steps_ms_and_prompt_tokens": steps,
            }
        )
        print(rows[-1], flush=True)
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def host_profile_rows(config_dir: str, token_counts=(16, 1024), steps: int = 20) -> list[dict]:
    """Host time to launch one step of a `tokens`-token prefill (the GPU left to catch up between steps), eager
    and from piecewise CUDA graphs, and each step's GPU time; then the 16-token steps under cProfile, whose top
    functions are printed."""
    import cProfile
    import pstats
    import time

    rows = []
    for mode, limit in (("eager", 0), ("piecewise", max(token_counts))):
        core = core_for(config_dir, 2, max(token_counts), piecewise_cuda_graph_max_tokens=limit)
        for tokens in token_counts:
            items = prefill_items(core, 1, tokens)
            for _ in range(3):
                core.runner.execute(items)
            torch.cuda.synchronize()
            launch = []
            for _ in range(steps):
                t = time.perf_counter()
                core.runner.execute(items)
                launch.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
            gpu = gpu_ms(lambda: core.runner.execute(items))
            rows.append(
                {
                    "bench": "host launch",
                    "model": Path(config_dir).name,
                    "mode": mode,
                    "tokens": tokens,
                    "host_launch_ms": median(launch),
                    "gpu_ms": gpu,
                }
            )
            if tokens == token_counts[0]:
                prof = cProfile.Profile()
                for _ in range(steps):
                    prof.enable()
                    core.runner.execute(items)
                    prof.disable()
                    torch.cuda.synchronize()
                print(
                    f"{Path(config_dir).name}: {mode} {tokens}-token step, host launch {median(launch):.2f} ms, "
                    f"GPU {gpu:.2f} ms; cProfile over {steps} steps:"
                )
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
            core.scheduler.free(items[0].request)
        del core
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def hf_vs_engine(config_dir: str, batch: int, prompt: int, new: int) -> dict:
    """transformers' own model vs this engine, same weights, batch of prompts, greedy, fixed lengths."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltamesh.engine.weights import load_tensors

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
    return {
        "bench": "transformers vs engine",
        "model": Path(config_dir).name,
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new,
        "hf_tokens_per_s": tokens / hf_ms * 1e3,
        "engine_tokens_per_s": tokens / engine_ms * 1e3,
        "ratio": hf_ms / engine_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dense", default=str(CONFIGS / "qwen3.5-9b"))
    p.add_argument("--moe", default=str(CONFIGS / "qwen3.5-35b-a3b"))
    p.add_argument("--context", type=int, default=9216)
    p.add_argument("--batches", type=ints, default=[64, 256], help="the dense model's decode batches")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--only-moe", action="store_true")
    p.add_argument("--only-decode", action="store_true", help="the dense decode rows only")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print a per-kernel breakdown of each decode step (and of the mixed steps)",
    )
    p.add_argument("--mixed", action="store_true", help="the mixed-step rows only (the dense model)")
    p.add_argument("--mixed-prefill", default="2x8192", help="prompts x chunk tokens of the mixed step")
    p.add_argument("--mixed-decodes", type=int, default=63, help="decode items of the mixed step, at --context")
    p.add_argument("--host-profile", action="store_true", help="the host time of steps with prompt tokens only")
    p.add_argument("--burst", action="store_true", help="64 prompts of 1024 tokens at once: steps and first tokens")
    p.add_argument("--ttft", action="store_true", help="the lone-prompt first-token rows only (dense, then MoE)")
    p.add_argument("--ttft-tokens", type=int, default=8192)
    p.add_argument("--out", default=str(RESULTS / "gpu_model.json"))
    args = p.parse_args()
    rows = []
    if args.burst:
        for config in (args.dense, args.moe):
            rows += burst_rows(config)
        print_table(
            rows, ["bench", "model", "burst", "prompts", "tokens", "ttft_min_ms", "ttft_median_ms", "ttft_max_ms"]
        )
        write_result(args.out, {"rows": rows}, machine_info())
        return
    if args.host_profile:
        for config in (args.moe, args.dense):
            rows += host_profile_rows(config)
        print_table(rows, ["bench", "model", "mode", "tokens", "host_launch_ms", "gpu_ms"])
        write_result(args.out, {"rows": rows}, machine_info())
        return
    if args.ttft:
        for config in (args.dense, args.moe):
            rows += ttft_rows(config, args.ttft_tokens)
            print_table(rows, ["bench", "model", "tokens", "prefix_cache", "ttft_ms", "steps", "step_ms"])
        write_result(args.out, {"rows": rows}, machine_info())
        return
    # the ceilings the rows below are compared against (the rows above need none)
    bandwidth, peak = hbm_bandwidth(), matmul_rate()
    print(f"measured: HBM copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    if args.mixed:
        prompts, chunk = ints(args.mixed_prefill.replace("x", ","))
        rows += mixed_rows(args.dense, prompts, chunk, args.mixed_decodes, args.context, args.profile)
        print_table(
            rows,
            [
                "bench",
                "prompts",
                "chunk",
                "decodes",
                "context",
                "prefill_ms",
                "decode_ms",
                "mixed_ms",
                "extra_ms",
                "prefill_tokens_per_s_mixed",
            ],
        )
        write_result(
            args.out, {"hbm_copy_bytes_per_s": bandwidth, "bf16_matmul_flops": peak, "rows": rows}, machine_info()
        )
        return
    if args.only_moe:
        args.skip_hf = True
    else:
        rows += decode_rows(args.dense, args.batches, args.context, bandwidth, args.profile)
        print_table(
            rows,
            [
                "bench",
                "model",
                "batch",
                "context",
                "ms",
                "host_prepare_ms",
                "graph_gpu_ms",
                "roofline_ms",
                "of_roofline",
                "tokens_per_s",
            ],
        )
        if args.only_decode:
            args.skip_hf = args.skip_moe = True
        else:
            rows.append(prefill_row(args.dense, 8192, peak))
            print_table(rows[-1:], ["bench", "model", "tokens", "ms", "tflops", "mfu", "tokens_per_s"])
    if not args.skip_hf:
        rows.append(hf_vs_engine(args.dense, 64, 1024, 128))
        print_table(
            rows[-1:], ["bench", "batch", "prompt", "new_tokens", "hf_tokens_per_s", "engine_tokens_per_s", "ratio"]
        )
    if not args.skip_moe:
        rows += decode_rows(args.moe, [64], 2048, bandwidth)
        print_table(
            rows[-1:], ["bench", "model", "batch", "context", "ms", "roofline_ms", "of_roofline", "tokens_per_s"]
        )
    payload = {"hbm_copy_bytes_per_s": bandwidth, "bf16_matmul_flops": peak, "rows": rows}
    write_result(args.out, payload, machine_info())


if __name__ == "__main__":
    main()

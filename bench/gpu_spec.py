"""Speculative decoding (MTP) on one GPU, dummy bf16 weights at real shapes: the cost of a verify step against the
plain decode step, and the TPOT it projects.

For each shape (`--models`: the 9B and 35B-A3B configs), each K (`--ks`; 0 is the plain decode step) and each
batch (`--batches`), one engine step of `batch` requests holding `--context` tokens each, as the engine runs it
from the host's inputs (runner.execute): with K > 0 every request verifies its last token and K drafts (K+1 rows),
the leader accepts, the GDN states are committed and the MTP module drafts the next K tokens; the verify-only step
replays its two CUDA graphs (spec/graphs.py), the plain one its decode graph. `wall_ms`: the step launched and its
tokens read back, host work included (async scheduling hides the host part behind the step before); `gpu_ms`:
the GPU's time between events around it.

The projection: a verify step yields 1 + a_1 + ... + a_K tokens per request on average, where a_j is the
probability that draft j is accepted (with all before it): `--acceptance`, by default the published per-position
acceptance of Qwen3.5's MTP under vLLM (0.80 / 0.63 / 0.50, issue #42). TPOT = step time / tokens per step, at
concurrency = batch (1 and 16 are the issue's, 64 where MTP must not be slower). `disable_batch` is the smallest
batch of the grid at which a K's projected TPOT is no better than the plain step's: what
`--speculative-disable-batch-size` should be below (the engine's default, 64, is the largest batch where every K paid on the 35B-A3B shape).

The JSON is rewritten after each engine (`"complete": false` until the last), so a run stopped by a time limit
(scripts/gpu_stage.sh v) keeps what it measured; `engine_build_s` is each engine's start-up.

    python bench/gpu_spec.py --out bench/results/gpu_spec.json
    python bench/gpu_spec.py --models bench/configs/qwen3.5-35b-a3b --ks 0,1,2,3 --batches 1,16,64 --context 8192
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
from bench.gpu_common import core_for, gpu_ms, host_list, machine_info, time_ms

PUBLISHED_ACCEPTANCE = (0.80, 0.63, 0.50)


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def verify_items(core, batch: int, context: int, k: int) -> list:
    """`batch` requests that hold `context` tokens and verify their last token and K drafts (random tokens, as
    dummy weights draft), with the pages a verify step may write (scheduler.spec_reach)."""
    items = decode_items(core, batch, context)
    vocab = core.model_config.vocab_size
    for i, it in enumerate(items):
        req = it.request
        core.kv_pool.free(req.pages)
        req.pages = core.kv_pool.alloc(core.kv_pool.pages_for(context + 3 * k + 1))
        req.draft_ids = [(104729 * i + 31 * j + 5) % vocab for j in range(k)]
        it.num_tokens, it.verify = k + 1, True
    return items


def step_rows(config_dir: str, k: int, batches: list[int], context: int, quantization: str) -> list[dict]:
    start = time.perf_counter()
    core = core_for(
        config_dir,
        max(batches),
        context,
        extra_tokens=64 + 3 * k,
        speculative_tokens=k,
        speculative_disable_batch_size=max(batches),
        quantization=quantization,
        piecewise_cuda_graph_max_tokens=0,  # steps with prompt tokens are not timed here
    )
    built_s = time.perf_counter() - start  # dummy weights, warm-up and CUDA graphs: what a run's time limit must allow
    rows = [timed_step(core, config_dir, k, batch, context) | {"engine_build_s": built_s} for batch in batches]
    core.close()
    return rows


def timed_step(core, config_dir: str, k: int, batch: int, context: int) -> dict:
    from deltamesh.engine.spec import tokens as spec_tokens
    from deltamesh.engine.spec.runner import SpecSampling

    if k:
        items = verify_items(core, batch, context, k)
        reqs = [it.request for it in items]
        sampling = SpecSampling(spec_tokens.accept_inputs(reqs, core.max_model_len), core.launcher.generator, reqs)

        def launch():
            return core.runner.execute(items, None, None, sampling)

        def read():
            return host_list(launch().next_tokens)
    else:
        items = decode_items(core, batch, context)

        def launch():
            return core.runner.execute(items)

        def read():
            return host_list(launch().argmax(-1))

    graph_steps = core.runner.graph_steps
    row = {
        "model": Path(config_dir).name,
        "k": k,
        "batch": batch,
        "context": context,
        "wall_ms": time_ms(read),
        "gpu_ms": gpu_ms(launch),
        "graphs": core.runner.graph_steps > graph_steps,
    }
    print_table([row], ["model", "k", "batch", "wall_ms", "gpu_ms", "graphs"])
    for it in items:
        core.scheduler.free(it.request)
    return row


def projections(rows: list[dict], acceptance: list[float]) -> list[dict]:
    """Per model, K > 0 and batch: tokens per step at `acceptance`, projected TPOT from the wall and the GPU time,
    and the speed-up over the plain step at the same batch."""
    plain = {(r["model"], r["batch"]): r for r in rows if r["k"] == 0}
    out = []
    for r in rows:
        base = plain.get((r["model"], r["batch"]))
        if r["k"] == 0 or base is None:
            continue
        per_step = 1 + sum(acceptance[: r["k"]])
        tpot = r["wall_ms"] / per_step
        out.append(
            {
                "model": r["model"],
                "k": r["k"],
                "batch": r["batch"],
                "verify_over_plain": r["wall_ms"] / base["wall_ms"],
                "tokens_per_step": per_step,
                "plain_tpot_ms": base["wall_ms"],
                "tpot_ms": tpot,
                "gpu_tpot_ms": r["gpu_ms"] / per_step,
                "speedup": base["wall_ms"] / tpot,
            }
        )
    return out


def disable_batches(projected: list[dict]) -> list[dict]:
    """Per model and K: the smallest batch measured where MTP stops paying (None: it pays at every batch)."""
    out = []
    for model, k in sorted({(p["model"], p["k"]) for p in projected}):
        mine = sorted((p for p in projected if (p["model"], p["k"]) == (model, k)), key=lambda p: p["batch"])
        worse = [p["batch"] for p in mine if p["speedup"] <= 1.0]
        out.append({"model": model, "k": k, "disable_batch": worse[0] if worse else None})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=f"{CONFIGS / 'qwen3.5-9b'},{CONFIGS / 'qwen3.5-35b-a3b'}")
    p.add_argument("--ks", type=ints, default=[0, 1, 2, 3], help="drafts per step (0: the plain decode step)")
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument(
        "--acceptance",
        type=floats,
        default=list(PUBLISHED_ACCEPTANCE),
        help="probability that draft j (and every one before it) is accepted, per position",
    )
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--out", default=str(RESULTS / "gpu_spec.json"))
    args = p.parse_args()
    ks = sorted(set(args.ks) | {0})
    if max(ks) > len(args.acceptance):
        p.error(f"--acceptance gives {len(args.acceptance)} positions, K goes to {max(ks)}")
    rows = []
    for model in args.models.split(","):
        for k in ks:
            rows += step_rows(model, k, args.batches, args.context, args.quantization)
            gc.collect()  # the engine of the last K, before the next one takes the GPU's memory
            torch.cuda.empty_cache()
            write(args.out, rows, args.acceptance, complete=False)  # what a time limit stops early still has
    projected, backoff = write(args.out, rows, args.acceptance, complete=True)
    print(f"\nprojected at per-position acceptance {args.acceptance}:")
    print_table(
        projected,
        ["model", "k", "batch", "verify_over_plain", "tokens_per_step", "plain_tpot_ms", "tpot_ms", "speedup"],
    )
    print_table(backoff, ["model", "k", "disable_batch"])
    print(f"wrote {args.out}")


def write(out: str, rows: list[dict], acceptance: list[float], complete: bool) -> tuple[list[dict], list[dict]]:
    """The JSON of the rows measured so far (`complete`: every model and K of the command)."""
    projected = projections(rows, acceptance)
    backoff = disable_batches(projected)
    payload = {"complete": complete, "acceptance": acceptance, "steps": rows, "projected": projected}
    write_result(out, payload | {"disable_batch": backoff}, machine_info())
    return projected, backoff


if __name__ == "__main__":
    main()

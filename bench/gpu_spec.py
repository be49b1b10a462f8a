"""Speculative decoding (MTP) on one GPU, dummy bf16 weights at real shapes: the cost of a verify step against the
plain decode step, and the TPOT it projects.
`floor_ms` is each step's roofline (floor_ms below: the bytes it must move at the measured copy bandwidth),
`of_floor` the share of it the measured GPU time reaches.

For each shape (`--models`: the 9B and 35B-A3B configs), each K (`--ks`; 0 is the plain decode step) and each
batch (`--batches`), one engine step of `batch` requests holding `--context` tokens each, as the engine runs it
from the host's inputs (runner.execute): with K > 0 every request verifies its last token and K drafts (K+1 rows),
the leader accepts, the GDN states are committed and the MTP module drafts the next K tokens; the verify-only step
replays its two CUDA graphs (spec/graphs.py), the plain one its decode graph. `wall_ms`: the step launched and its
tokens read back, host work included (async scheduling hides the host part behind the step before); `gpu_ms`:
the GPU's time between events around it (the host's preparation of the step included: the GPU waits for it);
`pipelined_ms`: per step of PIPELINED_STEPS launched back to back without a read between them, as async
scheduling runs a decode loop, so that the host prepares each step while the GPU runs the one before (when the
host is the slower, this is the host's time a step; timed from the end of a step launched before them:
gpu_common.pipelined_ms).

The projection: a verify step yields 1 + a_1 + ... + a_K tokens per request on average, where a_j is the
probability that draft j is accepted (with all before it): `--acceptance`, by default the published per-position
acceptance of Qwen3.5's MTP under vLLM (0.80 / 0.63 / 0.50, issue #42). TPOT = step time / tokens per step, at
concurrency = batch (1 and 16 are the issue's, 64 where MTP must not be slower). `disable_batch` is the smallest
batch of the grid at which a K's projected TPOT is no better than the plain step's: what
`--speculative-disable-batch-size` should be below (the engine's default, 64, is the largest batch where every K paid on the 35B-A3B shape).

`--draft-vocab N[,M...]` (default 0: the whole vocabulary): each K > 0 is measured once per value, N > 0 drafting
over the N lowest token ids (--speculative-draft-vocab N, spec/draft_vocab.py): each draft reads N rows of the LM
head instead of all of them, and `floor_ms` counts those. The projection keeps the published acceptance for every
N (a reduced vocabulary accepts less: bench/draft_vocab_acceptance.py measures how much on the default model).

`--small-weight-tokens N` (default triton_gemv.SMALL_WEIGHT_MAX_TOKENS; 0: off): up to N tokens a small weight (the
MoE router, GDN's b|a gates) runs the GEMV instead of cuBLAS, for an A/B of whole steps. `--small-weight-mib M`
(default triton_gemv.SMALL_WEIGHT_BYTES in MiB): what counts as small, for the same A/B.

`--profile-batch B` (default 1, 0: none): the plain step and the largest K's verify step at batch B, as they run
(graphs replayed), under the torch profiler: GPU time per kernel group and the slowest kernels (`kernels` in the
row), to show where a verify step's time goes beyond the plain step's, and the timeline of three steps launched back
to back (`timeline`: per step the span, the time kernels ran and the idle rest, and the kernels after which the GPU
idled longest, each with the gaps that followed it).

The JSON is rewritten after each engine (`"complete": false` until the last), so a run stopped by a time limit
(scripts/gpu_stage.sh v) keeps what it measured; `engine_build_s` is each engine's start-up.

    python bench/gpu_spec.py --out bench/results/gpu_spec.json
    python bench/gpu_spec.py --models bench/configs/qwen3.5-35b-a3b --ks 0,1,2,3 --batches 1,16,64 --context 8192
    python bench/gpu_spec.py --models bench/configs/qwen3.5-35b-a3b --ks 0,3 --batches 1 --draft-vocab 0,32768
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
    gpu_ms,
    hbm_bandwidth,
    host_list,
    kernel_breakdown,
    machine_info,
    pipelined_ms,
    time_ms,
)
from deltamesh.kernels import pdl, triton_gemv

PIPELINED_STEPS = 8  # steps launched back to back for `pipelined_ms`

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


def step_rows(
    config_dir: str,
    k: int,
    batches: list[int],
    context: int,
    quantization: str,
    bandwidth: float,
    profile_batch: int,
    draft_vocab: int = 0,
) -> list[dict]:
    """`draft_vocab`: N > 0 drafts over the N lowest token ids (K > 0 only), 0 over the whole vocabulary."""
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
        speculative_draft_vocab=str(draft_vocab) if draft_vocab and k else None,
    )
    built_s = time.perf_counter() - start  # dummy weights, warm-up and CUDA graphs: what a run's time limit must allow
    rows = [
        timed_step(core, config_dir, k, batch, context, bandwidth, profile=batch == profile_batch)
        | {"draft_vocab": draft_vocab if k else 0, "engine_build_s": built_s}
        for batch in batches
    ]
    core.close()
    return rows


def module_bytes(module: torch.nn.Module, rows: int, skip: tuple = ()) -> int:
    """Bytes one pass of `rows` tokens through `module` must read: every weight but the experts (and `skip`), and
    of each SparseMoE's experts those `rows` uniformly routed tokens are expected to touch (the dummy router spreads
    tokens about evenly: bench/gpu_moe.py's routing rows): E * (1 - (1 - k/E)^rows)."""
    from deltamesh.engine.models.layers import SparseMoE

    skipped = {id(p) for p in skip}
    experts = [m for m in module.modules() if isinstance(m, SparseMoE) and id(m.w13) not in skipped]
    skipped |= {id(p) for m in experts for p in (m.w13, m.w2)}
    dense = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in skipped)
    for m in experts:
        local = m.w13.shape[0]
        per_expert = (m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size()) / local
        touched = min(local, local * (1 - (1 - m.top_k / m.num_experts) ** rows))
        dense += int(touched * per_expert)
    return dense


def floor_ms(core, k: int, batch: int, context: int, bandwidth: float) -> float:
    """The step's roofline: bytes it must move at the GPU's measured bandwidth. The target's pass over (K+1) rows
    per request (its lm_head once), each request's KV and GDN state (read once, the K+1 verify states written);
    with K > 0 the MTP module's catch-up over the same rows and K - 1 further passes over one row per request, and
    the draft head once per draft: the whole lm_head, or with a reduced draft vocabulary its N hot rows
    (spec/draft_vocab.py)."""
    model = core.model
    rows = (k + 1) * batch
    mtp = [] if model.mtp is None else list(model.mtp.parameters())
    lm_head = model.lm_head.numel() * model.lm_head.element_size()
    total = module_bytes(model, rows, skip=(model.embed, *mtp)) + (lm_head if model.lm_head is model.embed else 0)
    total += rows * model.embed.shape[1] * model.embed.element_size()
    total += batch * context * core.kv_pool.page_bytes // core.kv_pool.page_size
    total += (1 + k + 1) * batch * core.state_pool.slot_bytes
    if k and model.mtp is not None:
        tied = (model.embed, model.lm_head)
        total += module_bytes(model.mtp, rows, skip=tied) + (k - 1) * module_bytes(model.mtp, batch, skip=tied)
        total += k * draft_head_bytes(core)
    return total / bandwidth * 1e3


def draft_head_bytes(core) -> int:
    """The LM head rows one draft reads: the drafter's reduced head's, else the whole lm_head's."""
    head = getattr(core.runner.spec.drafter, "head", None) if core.runner.spec is not None else None
    weight = core.model.lm_head if head is None else head.weight
    return weight.numel() * weight.element_size()


def timed_step(
    core, config_dir: str, k: int, batch: int, context: int, bandwidth: float, profile: bool = False
) -> dict:
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
        "pipelined_ms": pipelined_ms(launch, PIPELINED_STEPS),
        "graphs": core.runner.graph_steps > graph_steps,
        "pdl": pdl.MODE,  # programmatic dependent launch (DELTAMESH_PDL: kernels/pdl.py)
        "floor_ms": floor_ms(core, k, batch, context, bandwidth),
    }
    row["of_floor"] = row["floor_ms"] / row["gpu_ms"]
    print_table([row], ["model", "k", "batch", "wall_ms", "gpu_ms", "pipelined_ms", "floor_ms", "of_floor", "graphs"])
    if profile:
        timeline: dict = {}
        try:  # a diagnostic: a profiler failure must not cost the stage its remaining rows
            groups, top = kernel_breakdown(core, items, steps=3, top=25, step=launch, timeline=timeline)
        except Exception as e:
            row["kernels_error"] = repr(e)
            print(f"profile failed: {e!r}")
        else:
            row["kernels"] = {"groups": groups, "top": top, "timeline": timeline}
            print_table(groups, ["group", "kernels", "calls", "ms"])
            print_table(top, ["kernel", "calls", "ms"])
            print(
                f"timeline per step, steps back to back: span {timeline['span_ms']:.3f} ms, kernels busy "
                f"{timeline['busy_ms']:.3f}, idle {timeline['idle_ms']:.3f}, {timeline['kernels']:.0f} kernels; "
                "idle after:"
            )
            print_table(timeline["after"], ["kernel", "gaps", "ms", "largest_us"])
            print("launched most often:")
            print_table(timeline["frequent"], ["kernel", "launches", "us", "us_each"])
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
                "draft_vocab": r["draft_vocab"],
                "batch": r["batch"],
                "verify_over_plain": r["wall_ms"] / base["wall_ms"],
                "tokens_per_step": per_step,
                "plain_tpot_ms": base["wall_ms"],
                "tpot_ms": tpot,
                "gpu_tpot_ms": r["gpu_ms"] / per_step,
                "floor_tpot_ms": r["floor_ms"] / per_step,  # the verify step at its roofline
                "speedup": base["wall_ms"] / tpot,
                # steps back to back, as async scheduling runs them: the host's preparation hidden behind the GPU
                "pipelined_plain_tpot_ms": base["pipelined_ms"],
                "pipelined_tpot_ms": r["pipelined_ms"] / per_step,
                "pipelined_speedup": base["pipelined_ms"] * per_step / r["pipelined_ms"],
            }
        )
    return out


def disable_batches(projected: list[dict]) -> list[dict]:
    """Per model, K and draft vocabulary: the smallest batch measured where MTP stops paying (None: it pays at
    every batch)."""
    out = []
    for model, k, vocab in sorted({(p["model"], p["k"], p["draft_vocab"]) for p in projected}):
        mine = [p for p in projected if (p["model"], p["k"], p["draft_vocab"]) == (model, k, vocab)]
        worse = [p["batch"] for p in sorted(mine, key=lambda p: p["batch"]) if p["speedup"] <= 1.0]
        out.append({"model": model, "k": k, "draft_vocab": vocab, "disable_batch": worse[0] if worse else None})
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
    p.add_argument(
        "--draft-vocab",
        type=ints,
        default=[0],
        help="measure each K > 0 drafting over the N lowest token ids, for each N given (0: the whole vocabulary)",
    )
    p.add_argument("--profile-batch", type=int, default=1, help="profile K=0 and the largest K at this batch (0: none)")
    p.add_argument(
        "--small-weight-tokens",
        type=int,
        default=triton_gemv.SMALL_WEIGHT_MAX_TOKENS,
        help="triton_gemv.SMALL_WEIGHT_MAX_TOKENS for every engine (0: small weights take cuBLAS past one token)",
    )
    p.add_argument(
        "--small-weight-mib",
        type=float,
        default=triton_gemv.SMALL_WEIGHT_BYTES / (1 << 20),
        help="triton_gemv.SMALL_WEIGHT_BYTES in MiB for every engine (weights up to it take the GEMV at a few tokens)",
    )
    p.add_argument("--out", default=str(RESULTS / "gpu_spec.json"))
    args = p.parse_args()
    # before the engines capture their graphs
    triton_gemv.SMALL_WEIGHT_MAX_TOKENS = args.small_weight_tokens
    triton_gemv.SMALL_WEIGHT_BYTES = int(args.small_weight_mib * (1 << 20))
    ks = sorted(set(args.ks) | {0})
    if max(ks) > len(args.acceptance):
        p.error(f"--acceptance gives {len(args.acceptance)} positions, K goes to {max(ks)}")
    rows = []
    bandwidth = hbm_bandwidth()  # before any engine holds the GPU's memory
    if min(args.draft_vocab) < 0:
        p.error("--draft-vocab takes counts of token ids >= 0 (0: the whole vocabulary)")
    for model in args.models.split(","):
        for k in ks:
            profile_batch = args.profile_batch if k in (0, max(ks)) else 0
            for vocab in args.draft_vocab if k else [0]:  # the plain step drafts nothing
                rows += step_rows(
                    model, k, args.batches, args.context, args.quantization, bandwidth, profile_batch, vocab
                )
                gc.collect()  # the engine of the last K, before the next one takes the GPU's memory
                torch.cuda.empty_cache()
                write(args.out, rows, args.acceptance, complete=False)  # what a time limit stops early still has
    projected, backoff = write(args.out, rows, args.acceptance, complete=True)
    print(f"\nprojected at per-position acceptance {args.acceptance}:")
    print_table(
        projected,
        [
            "model",
            "k",
            "draft_vocab",
            "batch",
            "verify_over_plain",
            "tokens_per_step",
            "plain_tpot_ms",
            "tpot_ms",
            "floor_tpot_ms",
            "speedup",
            "pipelined_tpot_ms",
            "pipelined_speedup",
        ],
    )
    print_table(backoff, ["model", "k", "draft_vocab", "disable_batch"])
    print(f"wrote {args.out}")


def write(out: str, rows: list[dict], acceptance: list[float], complete: bool) -> tuple[list[dict], list[dict]]:
    """The JSON of the rows measured so far (`complete`: every model and K of the command)."""
    projected = projections(rows, acceptance)
    backoff = disable_batches(projected)
    payload = {
        "complete": complete,
        "acceptance": acceptance,
        "small_weight_tokens": triton_gemv.SMALL_WEIGHT_MAX_TOKENS,
        "small_weight_bytes": triton_gemv.SMALL_WEIGHT_BYTES,
        "steps": rows,
        "projected": projected,
        "disable_batch": backoff,
    }
    write_result(out, payload, machine_info())
    return projected, backoff


if __name__ == "__main__":
    main()

"""How long the GPU waits for the host between decode steps, with async scheduling on and off.

The engine steps a steady decode batch (every request past its prompt) exactly as a worker does
(`EngineCore.step`: scheduling, input preparation, sampling, stop checks, detokenising); the profiler records the
GPU's kernels and copies over a window of steps. Busy time is the union of their intervals; the gap is the rest of
the window: time the GPU had nothing queued. The goal of the serving-loop issue: under 5 % of the step at batch
>= 16.

    python bench/host_gap.py --out bench/results/host_gap_h200.json                   # 35B-A3B and 9B shapes
    python bench/host_gap.py --models bench/configs/qwen3.5-9b --batches 1,16 --context 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.common import fmt, ints, table, write_result  # noqa: E402
from deltamesh.engine import EngineConfig, SamplingParams  # noqa: E402
from deltamesh.engine.core import EngineCore  # noqa: E402


def busy_us(prof) -> tuple[float, float]:
    """(union of the GPU events' intervals, span from the first start to the last end), in microseconds."""
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not spans:
        return 0.0, 0.0
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    return busy, spans[-1][1] - spans[0][0]


def measure(core: EngineCore, batch: int, context: int, steps: int, async_scheduling: bool) -> dict:
    core.config.async_scheduling = async_scheduling
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps * 3 + 16, temperature=0, ignore_eos=True)
    vocab = core.model_config.vocab_size
    reqs = [
        core.make_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params) for _ in range(batch)
    ]
    for r in reqs:
        core.submit(r, lambda out: None)
    core.process_commands()
    while any(len(r.output_ids) < 4 for r in reqs):  # prompts done, decode graphs in use
        core.step()
    cuda = core.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            core.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    busy, span = busy_us(prof) if cuda else (0.0, 0.0)
    for r in reqs:
        core.abort(r.request_id)
    core.process_commands()
    while core.has_work:
        core.step()
    return {
        "batch": batch,
        "async_scheduling": async_scheduling,
        "step_ms": wall / steps * 1e3,
        "gpu_busy_ms": busy / steps / 1e3,
        "gap_pct": 100 * (1 - busy / span) if span else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bench/configs/qwen3.5-35b-a3b,bench/configs/qwen3.5-9b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=ints, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=8192, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=40, help="decode steps in the profiled window")
    p.add_argument("--out")
    args = p.parse_args()
    batches = args.batches
    rows = []
    for model in args.models.split(","):
        config = EngineConfig(
            model=str(ROOT / model) if not Path(model).is_absolute() else model,
            load_format="dummy",
            device=args.device,
            max_num_seqs=max(batches),
            max_model_len=args.context + 4 * args.steps + 64,
            max_num_batched_tokens=16384,
            prefix_cache=False,
        )
        core = EngineCore(config)
        for batch in batches:
            for async_scheduling in (False, True):
                row = {"model": Path(model).name, **measure(core, batch, args.context, args.steps, async_scheduling)}
                rows.append(row)
                print(row, flush=True)
        del core
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(
        table(
            ["model", "batch", "async", "step ms", "GPU busy ms", "GPU idle %"],
            [
                [
                    r["model"],
                    r["batch"],
                    r["async_scheduling"],
                    fmt(r["step_ms"]),
                    fmt(r["gpu_busy_ms"]),
                    fmt(r["gap_pct"]),
                ]
                for r in rows
            ],
        )
    )
    if args.out:
        write_result(args.out, {"benchmark": "host_gap", "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

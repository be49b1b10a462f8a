"""Engine step times for waves of long prompts: finds steps that are slow the first time a batch shape
appears (kernel compilation or autotuning the worker's warm-up missed). Each wave submits N prompts at once
and steps until done; every step is timed with the device synchronised, and steps slower than --slow-ms are
printed with their shape (tokens per request, largest first). A shape that is slow in the first wave but not
in the second is a first-use cost.

    python bench/step_times.py --out step_times.json                          # 9B shape, dummy weights, GPU
    python bench/step_times.py --model models/deltamesh-tiny --device cpu --prompt-len 64 --slow-ms 100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import CONFIGS, write_result
from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-9b"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--waves", default="1:4,8:64,8:64,16:16", help="requests:max_tokens per wave, in order")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="as the serving benchmark's workers")
    p.add_argument("--slow-ms", type=float, default=500.0)
    p.add_argument("--out")
    args = p.parse_args()

    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=128,
        max_model_len=args.prompt_len + 1040,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache=False,
    )
    started = time.perf_counter()
    core = EngineCore(config)  # includes the worker's warm-up
    print(f"engine ready in {time.perf_counter() - started:.1f}s", flush=True)
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    execute, steps = core.runner.execute, []

    def timed(items):
        sync()
        t0 = time.perf_counter()
        out = execute(items)
        sync()
        steps.append((time.perf_counter() - t0, sorted((it.num_tokens for it in items), reverse=True)))
        return out

    core.runner.execute = timed
    gen = torch.Generator().manual_seed(0)
    vocab = core.model_config.vocab_size
    waves = []
    for spec in args.waves.split(","):
        n, max_tokens = (int(x) for x in spec.split(":"))
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for _ in range(n):
            prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            core.submit(core.make_request(prompt, params), lambda out: None)
        core.process_commands()
        steps.clear()
        while core.has_work:
            core.step()
        slow = [
            {"ms": round(s * 1e3, 1), "requests": len(shape), "tokens": shape[:4]}
            for s, shape in steps
            if s * 1e3 > args.slow_ms
        ]
        waves.append({"requests": n, "max_tokens": max_tokens, "steps": len(steps), "slow_steps": slow})
        print(
            f"wave of {n} x {args.prompt_len} tokens: {len(steps)} steps; slower than {args.slow_ms:g} ms: "
            + (", ".join(f"{s['ms']} ms {s['tokens']}.. ({s['requests']} requests)" for s in slow) or "none")
        )
    if args.out:
        write_result(args.out, {"benchmark": "step_times", "settings": vars(args), "waves": waves})


if __name__ == "__main__":
    main()

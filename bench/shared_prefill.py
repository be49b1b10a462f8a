"""n copies of one prompt submitted together, with and without the engine's shared prefill (engine/shared_prefill.py:
a waiting request lets a running prefill of its prefix reach a checkpoint, then starts from the prefix cache).

    .venv/bin/python bench/shared_prefill.py --out bench/results/shared_prefill.json

Each row: the wall time of `Engine.generate([prompt] * n)` (greedy, ignore EOS), median over `--reps` prompts of
random tokens, once with the rule and once with it off (`shared_prefill.MIN_SHARED_TOKENS` out of reach), on the
default model unless `--model` (on a GPU: `--device cuda --load-format dummy --model bench/configs/qwen3.5-9b
--prompt-lens 1024,4096`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ints, median, print_table, write_result
from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams, shared_prefill


def timed(engine: Engine, prompt_len: int, n: int, reps: int, output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    vocab = engine.core.model_config.vocab_size
    times = []
    for rep in range(reps):
        rng = random.Random(rep * 1000 + prompt_len)
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        start = time.perf_counter()
        engine.generate([prompt] * n, params)
        times.append(time.perf_counter() - start)
    return median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompt-lens", type=ints, default=[200, 500])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--load-format", default="auto", help="dummy for a shape of bench/configs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step budget (default: the engine's)")
    ap.add_argument("--out", default=str(RESULTS / "shared_prefill.json"))
    args = ap.parse_args()
    rule = shared_prefill.MIN_SHARED_TOKENS
    rows = []
    config = EngineConfig(
        model=args.model,
        torch_threads=args.torch_threads,
        device=args.device,
        load_format=args.load_format,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    with Engine(config) as engine:
        engine.generate([[1] * 50], SamplingParams(max_tokens=2))  # first-call costs out of the rows
        for prompt_len in args.prompt_lens:
            row = {"prompt_tokens": prompt_len, "n": args.n}
            for name, threshold in (("off_s", 10**9), ("on_s", rule)):
                shared_prefill.MIN_SHARED_TOKENS = threshold
                row[name] = round(timed(engine, prompt_len, args.n, args.reps, args.output_len), 3)
            shared_prefill.MIN_SHARED_TOKENS = rule
            row["change_pct"] = round(100 * (row["on_s"] / row["off_s"] - 1), 1)
            rows.append(row)
            print(row, flush=True)
    print_table(rows, ["prompt_tokens", "n", "off_s", "on_s", "change_pct"])
    print(write_result(args.out, {"rows": rows}))


if __name__ == "__main__":
    main()

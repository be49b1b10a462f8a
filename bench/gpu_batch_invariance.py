"""Control for the bf16 fidelity figure: the monolithic engine against itself, the same 100 prompts run all
in one continuous batch vs one request at a time. With random bf16 weights the logits are nearly flat, so
greedy choices flip with the rounding of differently shaped batches; this measures how often, with no
disaggregation involved.

    python bench/gpu_batch_invariance.py --out bench/results/gpu_batch_invariance.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, RESULTS, median, write_result
from bench.gpu_common import machine_info
from deltamesh.engine import Engine, EngineConfig, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-9b"))
    p.add_argument("--out", default=str(RESULTS / "gpu_batch_invariance.json"))
    args = p.parse_args()
    rng = random.Random(0)  # the same prompts as bench/gpu_fidelity.py
    prompts = [[rng.randrange(10, 30000) for _ in range(rng.randint(16, 512))] for _ in range(100)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=2)
    with Engine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_model_len=1024,
            prefix_cache=False,
        )
    ) as eng:
        batched = eng.generate(prompts, params)
        alone = [eng.generate(p, params)[0] for p in prompts]
    exact = sum(a.token_ids == b.token_ids for a, b in zip(batched, alone))
    margins = [lp.top[0][1] - lp.top[1][1] for r in batched for lp in r.logprobs[:1] if len(lp.top) > 1]
    first = [
        next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for a, b in zip(batched, alone)
    ]
    diverged = [d for d in first if d is not None]
    result = {
        "prompts": 100,
        "tokens": 64,
        "exact_sequences": exact,
        "first_divergence_median": median(diverged) if diverged else None,
        "first_token_top1_top2_margin_median": median(margins) if margins else None,
    }
    print(json.dumps(result))
    write_result(args.out, result, machine_info())


if __name__ == "__main__":
    main()

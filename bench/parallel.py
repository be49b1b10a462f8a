"""One engine over N ranks against the same engine on one rank: prefill and decode throughput of the
monolithic engine (`Engine.generate`, no services), per layout: `1`, `tpN` (tensor parallel), `epN` (tensor
parallel, experts whole), `dpN` (data-parallel attention), `depN` (data-parallel attention, experts whole: the
disaggregated recipe's decode layout).

- prefill: --batch prompts of --prompt tokens, max_tokens 1; tokens/s = prompt tokens / wall time.
- decode: the same prompts with --decode-tokens greedy tokens each (ignore EOS); decode tokens/s = the extra
  tokens / the extra wall time over the prefill run; ms per step = that time / --decode-tokens.
Each rank count is warmed up once before it is timed. On CPU the ranks are processes on the same cores
(gloo): the figures there check the path, not speed; on GPUs each rank has its own (NCCL).

    python bench/parallel.py --tp 1,2                                                # CPU, the embedded model
    python bench/parallel.py --device cuda --model bench/configs/qwen3.5-35b-a3b --load-format dummy --tp 1,2 \\
        --batch 16 --prompt 8192 --decode-tokens 128                                  # make bench-parallel
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, machine_info, print_table, write_result
from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.defaults import DEFAULT_MODEL
from deltamesh.engine.engine import Engine


def timed(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(c.error is None and len(c.token_ids) == max_tokens for c in done), [c.error for c in done]
    return elapsed


def layout(spec: str) -> dict:
    """EngineConfig fields of a layout name (see the module's docstring)."""
    if spec == "1":
        return {}
    match = re.fullmatch(r"(tp|ep|dp|dep)(\d+)", spec)
    if match is None:
        raise ValueError(f"unknown layout {spec!r}: 1, tpN, epN, dpN or depN")
    kind, count = match.group(1), int(match.group(2))
    size = "data_parallel_size" if kind.endswith("dp") else "tensor_parallel_size"
    return {size: count, "enable_expert_parallel": kind.startswith(("ep", "dep"))}


def row(args, spec: str) -> dict:
    fields = layout(spec)
    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        **fields,
        max_num_seqs=max(args.batch, 1),
        max_model_len=args.prompt + args.decode_tokens + 64,
        prefix_cache=False,
    )
    with Engine(config) as engine:
        vocab = engine.core.model_config.vocab_size
        prompts = [[(7 * i + 13 * j) % vocab for j in range(args.prompt)] for i in range(args.batch)]
        timed(engine, prompts[:1], 2)  # warm-up
        prefill_s = timed(engine, prompts, 1)
        total_s = timed(engine, prompts, 1 + args.decode_tokens)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "layout": spec,
        "ranks": config.num_ranks,
        "batch": args.batch,
        "prompt": args.prompt,
        "prefill_s": prefill_s,
        "prefill_tok_s": args.batch * args.prompt / prefill_s,
        "decode_tok_s": args.batch * args.decode_tokens / decode_s,
        "decode_ms_per_step": decode_s / args.decode_tokens * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--layouts", type=lambda s: s.split(","), default=["1", "tp2"], help="comma-separated: 1, tpN, epN, dpN, depN"
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS / "parallel.json"))
    args = p.parse_args()
    for spec in args.layouts:
        layout(spec)  # every name checked before the first engine starts
    rows = [row(args, spec) for spec in args.layouts]
    print_table(rows, ["layout", "ranks", "batch", "prompt", "prefill_tok_s", "decode_tok_s", "decode_ms_per_step"])
    write_result(args.out, {"rows": rows}, machine_info())


if __name__ == "__main__":
    main()

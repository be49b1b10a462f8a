"""Disaggregated vs monolithic greedy output on GPUs: prefill on GPU 0, decode on GPU 1 (GPU 0 as well on a
one-GPU host: two processes, the pull still over UCX's cuda_ipc), against the monolithic engine on GPU 0.

- the embedded default model in fp32: must be token-exact;
- the dummy Qwen3.5-9B-shaped model in bf16: reports the greedy match rate over 100 prompts x 64 tokens.

    python bench/gpu_fidelity.py --out bench/results/gpu_fidelity.json
    python bench/gpu_fidelity.py --only fp32 --out bench/results/gpu_fidelity_fp32.json
    python bench/gpu_fidelity.py --only fp32 --decode-device cuda:0 --worker-flag=--gpu-memory-utilization=0.3
        # 1P+1D on one GPU, each worker in its share (gpu_stage.sh 1)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

from harness import start_mesh  # noqa: E402

from bench.common import CONFIGS, RESULTS, write_result  # noqa: E402
from bench.gpu_common import machine_info  # noqa: E402
from deltamesh.client import AsyncClient  # noqa: E402
from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams  # noqa: E402


async def through_mesh(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async with AsyncClient(address) as client:
        sem = asyncio.Semaphore(32)

        async def one(p):
            async with sem:
                return (await client.generate(p, max_tokens=max_tokens, temperature=0, ignore_eos=True)).token_ids

        return await asyncio.gather(*(one(p) for p in prompts))


def compare(
    model: str, dtype: str, n: int, max_tokens: int, extra: list[str], log_dir: Path, decode_device: str
) -> dict:
    rng = random.Random(0)
    vocab = json.loads((Path(model) / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    prompts = [[rng.randrange(10, min(vocab, 30000)) for _ in range(rng.randint(16, 512))] for _ in range(n)]
    args = ["--dtype", dtype, "--no-ucx-error-handling", "--max-model-len", "1024", *extra]
    mesh = start_mesh(
        model,
        log_dir,
        worker_args=args,
        router_args=["--max-model-len", "1024"],
        role_args={"prefill": ["--device", "cuda:0"], "decode": ["--device", decode_device]},
    )
    try:
        disagg = asyncio.run(through_mesh(mesh.router_address, prompts, max_tokens))
    finally:
        mesh.stop()
    with Engine(
        EngineConfig(
            model=model,
            device="cuda",
            dtype=dtype,
            max_model_len=1024,
            load_format="dummy" if "--load-format" in extra else "auto",
        )
    ) as mono:
        ref = [
            r.token_ids
            for r in mono.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        ]
    exact = sum(a == b for a, b in zip(disagg, ref))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(disagg, ref)]
    diverged = [d for d in first_diff if d is not None]
    return {
        "model": Path(model).name,
        "dtype": dtype,
        "decode_device": decode_device,
        "worker_flags": extra,
        "prompts": n,
        "tokens": max_tokens,
        "exact_sequences": exact,
        "match_rate": exact / n,
        "token_match_rate": sum(x == y for a, b in zip(disagg, ref) for x, y in zip(a, b)) / (n * max_tokens),
        "first_divergence_positions": sorted(diverged),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / "gpu_fidelity.json"))
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--only", choices=["fp32", "bf16"], help="run only this comparison")
    p.add_argument("--decode-device", help="the decode worker's GPU (default: cuda:1, cuda:0 on a one-GPU host)")
    p.add_argument("--worker-flag", action="append", default=[], help="extra flag for both workers (repeatable)")
    args = p.parse_args()
    decode_device = args.decode_device or ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    rows = []
    if args.only != "bf16":
        rows.append(compare(str(DEFAULT_MODEL), "float32", 32, 64, args.worker_flag, Path(args.log_dir), decode_device))
        print(json.dumps(rows[-1]), flush=True)
    if args.only != "fp32":
        rows.append(
            compare(
                str(CONFIGS / "qwen3.5-9b"),
                "bfloat16",
                100,
                64,
                ["--load-format", "dummy", *args.worker_flag],
                Path(args.log_dir),
                decode_device,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    write_result(args.out, {"rows": rows}, machine_info())


if __name__ == "__main__":
    main()

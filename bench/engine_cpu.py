"""CPU engine benchmark: prefill and decode throughput of `EngineCore`, stepped directly (no threads, no
services), on the embedded default model and on a dummy-weight Qwen3.5-0.8B-shaped model.

    .venv/bin/python bench/engine_cpu.py --out bench/results/engine_cpu.json   # full run (many minutes)
    .venv/bin/python bench/engine_cpu.py --quick                               # smoke run (< 1 minute)
    .venv/bin/python bench/engine_cpu.py --model bench/configs/qwen3.5-9b --load-format dummy \\
        --prefill-lens 128 --prefill-batches 1 --decode-batches 1           # any other model

What is measured (only `EngineCore.step()` calls are timed; command handling and output dispatch are not):
- prefill: B requests of L random prompt tokens, max_tokens=1, submitted together; the time of every step
  until all have their first token (chunked by --max-num-batched-tokens, as the engine serves). tokens/s =
  B * L / time.
- decode: B requests of --decode-context prompt tokens (greedy, ignore_eos) are first prefilled and run
  until every one of them has left prefill (untimed), then --decode-steps steps of pure decode (B tokens
  each, checked) are timed. tokens/s = B * steps / time; ms/step is the per-token latency (TPOT).
Each model is warmed up once (a short prefill + a few decode steps) before anything is timed; each case
runs --reps times and the median is reported (every sample is in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    CONFIGS,
    RESULTS,
    ROOT,
    busy_warning,
    ints,
    machine_info,
    median,
    rel,
    table,
    utc_now,
    write_result,
)


@dataclass
class ModelSpec:
    name: str
    model: str
    load_format: str
    prefill_lens: list[int]
    prefill_batches: list[int]
    decode_batches: list[int]
    decode_steps: int


@dataclass
class Case:
    phase: str  # prefill | decode
    prompt_len: int
    batch: int
    tokens: int = 0  # tokens processed per sample
    steps: int = 0
    seconds: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return median(self.seconds)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.median_s if self.seconds else float("nan")

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.median_s / self.steps if self.steps else float("nan")

    def to_json(self) -> dict:
        return {
            "phase": self.phase,
            "prompt_len": self.prompt_len,
            "batch": self.batch,
            "tokens": self.tokens,
            "steps": self.steps,
            "seconds_median": self.median_s,
            "seconds": self.seconds,
            "tokens_per_s": self.tok_s,
            "ms_per_step": self.ms_per_step,
        }


PRESETS = {
    # name: (model dir, load format, prefill lengths, prefill batches, decode batches)
    "tiny": (str(ROOT / "models" / "deltamesh-tiny"), "auto", [512, 2048], [1, 4], [1, 8, 32]),
    "0.8b": (str(CONFIGS / "qwen3.5-0.8b"), "dummy", [512, 2048], [1, 4], [1, 4, 16]),
}
QUICK = {
    "tiny": ([128, 512], [1, 4], [1, 8], 16),
    "0.8b": ([128], [1], [1, 4], 4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,0.8b", help="presets to run, comma-separated: tiny, 0.8b")
    p.add_argument("--model", help="run this checkpoint directory instead of the presets")
    p.add_argument("--load-format", default="auto", help="with --model: auto | safetensors | dummy")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: small sizes, 1 rep, 1 torch thread unless --threads (under a minute)",
    )
    p.add_argument("--prefill-lens", type=ints, help="prompt lengths for prefill (default per preset)")
    p.add_argument("--prefill-batches", type=ints, help="prefill batch sizes (default per preset)")
    p.add_argument("--decode-batches", type=ints, help="decode batch sizes (default per preset)")
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens before decode (default 128)")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32; quick 16/4)")
    p.add_argument("--reps", type=int, default=None, help="samples per case, median reported (default 3; quick 1)")
    p.add_argument("--dtype", default="float32", help="weights / KV dtype (default float32)")
    p.add_argument("--state-dtype", default="float32", help="GDN recurrent state dtype (default float32)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="step token budget (prefill chunk)")
    p.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size (default: what the cases need)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--kernels", default=None, help="kernel backend override (engine --kernels syntax)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "engine_cpu.json"), help="JSON results")
    return p.parse_args(argv)


def model_specs(args) -> list[ModelSpec]:
    if args.model:
        names = [("custom", args.model, args.load_format, [512, 2048], [1, 4], [1, 4, 16])]
        quick = {"custom": QUICK["0.8b"]}
    else:
        names = []
        for n in [x.strip() for x in args.models.split(",") if x.strip()]:
            if n not in PRESETS:
                raise SystemExit(f"unknown preset {n!r}; choose from {', '.join(PRESETS)} or pass --model DIR")
            names.append((n, *PRESETS[n]))
        quick = QUICK
    specs = []
    for name, model, fmt, plens, pbatches, dbatches in names:
        steps = 32
        if args.quick:
            plens, pbatches, dbatches, steps = quick[name]
        specs.append(
            ModelSpec(
                name,
                model,
                fmt,
                args.prefill_lens or plens,
                args.prefill_batches or pbatches,
                args.decode_batches or dbatches,
                args.decode_steps or steps,
            )
        )
    return specs


class Bench:
    """One EngineCore, reused across cases (pools must be empty again after each)."""

    def __init__(self, spec: ModelSpec, args):
        import torch

        from deltamesh.engine import EngineConfig
        from deltamesh.engine.core import EngineCore

        self.spec, self.args = spec, args
        self.decode_max_tokens = spec.decode_steps + 64  # room for the decode steps taken while others prefill
        max_batch = max(spec.prefill_batches + spec.decode_batches)
        longest = max(max(spec.prefill_lens), args.decode_context + self.decode_max_tokens)
        pages_for = lambda n: -(-n // args.page_size)  # noqa: E731
        need = max(
            max(spec.prefill_batches) * pages_for(max(spec.prefill_lens) + 1),
            max(spec.decode_batches) * pages_for(args.decode_context + self.decode_max_tokens),
        )
        self.config = EngineConfig(
            model=spec.model,
            load_format=spec.load_format,
            dtype=args.dtype,
            state_dtype=args.state_dtype,
            page_size=args.page_size,
            num_kv_pages=args.num_kv_pages or need + 8,
            max_num_seqs=max_batch,
            max_model_len=longest + 16,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kernel_backend=args.kernels,
            seed=args.seed,
            torch_threads=args.threads,
            prefix_cache=False,
            async_scheduling=False,  # each timed step's tokens read back before the next (a step's own time)
        )
        t0 = time.perf_counter()
        self.core = EngineCore(self.config)
        self.load_seconds = time.perf_counter() - t0
        self.params = sum(p.numel() for p in self.core.model.parameters())
        self.gen = torch.Generator().manual_seed(args.seed)
        self._n = 0

    # -- helpers ---------------------------------------------------------------------------------------
    def prompts(self, n: int, length: int) -> list[list[int]]:
        import torch

        vocab = self.core.model_config.vocab_size
        return [torch.randint(0, vocab, (length,), generator=self.gen).tolist() for _ in range(n)]

    def submit(self, prompts: list[list[int]], max_tokens: int) -> list:
        from deltamesh.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = []
        for p in prompts:
            self._n += 1
            reqs.append(self.core.make_request(p, params, f"bench-{self._n}"))
        for r in reqs:
            self.core.submit(r, lambda out: None)
        self.core.dispatch(self.core.process_commands())
        return reqs

    def step(self) -> tuple[list, float]:
        t0 = time.perf_counter()
        outs = self.core.step()
        dt = time.perf_counter() - t0
        self.core.dispatch(outs)
        return outs, dt

    def drain(self, reqs) -> None:
        for r in reqs:
            self.core.abort(r.request_id)
        self.core.dispatch(self.core.process_commands())
        assert not self.core.has_work, "requests left behind"
        assert self.core.kv_pool.num_used == 0 and self.core.state_pool.num_used == 0, "pool leak"

    # -- phases ----------------------------------------------------------------------------------------------
    def prefill(self, length: int, batch: int) -> tuple[float, int]:
        """Seconds of stepping until all `batch` prompts of `length` tokens have their first token."""
        reqs = self.submit(self.prompts(batch, length), max_tokens=1)
        elapsed, steps = 0.0, 0
        while self.core.has_work:
            _, dt = self.step()
            elapsed += dt
            steps += 1
        if any(len(r.output_ids) != 1 for r in reqs):
            raise RuntimeError("prefill did not produce exactly one token per request")
        self.drain([])
        return elapsed, steps

    def decode(self, batch: int, steps: int) -> float:
        """Seconds of `steps` pure decode steps of `batch` requests (prefill done beforehand, untimed)."""
        reqs = self.submit(self.prompts(batch, self.args.decode_context), max_tokens=self.decode_max_tokens)
        while any(not r.output_ids for r in reqs):  # until every request left prefill
            self.step()
            if not self.core.has_work:
                raise RuntimeError("requests finished before decode was measured")
        elapsed = 0.0
        for _ in range(steps):
            outs, dt = self.step()
            if len(outs) != batch or any(o.finished for o in outs):
                raise RuntimeError(f"a timed decode step ran {len(outs)} tokens, expected {batch}")
            elapsed += dt
        if self.core.scheduler.num_preemptions:
            raise RuntimeError("preemptions during the benchmark: raise --num-kv-pages")
        self.drain(reqs)
        return elapsed

    def warm_up(self) -> None:
        self.prefill(min(64, min(self.spec.prefill_lens)), 1)
        self.decode(1, 4)


def run_model(spec: ModelSpec, args, reps: int) -> dict:
    model_dir = Path(spec.model)
    if not (model_dir / "config.json").is_file():
        msg = f"{rel(model_dir)}: no config.json"
        if spec.name == "tiny":
            msg += " (the embedded default model is not built: .venv/bin/python scripts/make_default_model.py)"
        print(f"[{spec.name}] skipped: {msg}", flush=True)
        return {"name": spec.name, "model": rel(spec.model), "skipped": msg}
    print(f"[{spec.name}] loading {rel(spec.model)} ({spec.load_format}, {args.dtype})", flush=True)
    bench = Bench(spec, args)
    decode_steps = spec.decode_steps
    print(
        f"[{spec.name}] {bench.params / 1e9:.3f}B parameters, loaded in {bench.load_seconds:.1f}s, "
        f"{bench.core.kv_pool.num_pages} KV pages, kernels {bench.core.kernels.chosen}",
        flush=True,
    )
    bench.warm_up()
    cases: list[Case] = []
    for length in spec.prefill_lens:
        for batch in spec.prefill_batches:
            case = Case("prefill", length, batch, tokens=length * batch)
            for _ in range(reps):
                s, case.steps = bench.prefill(length, batch)
                case.seconds.append(s)
            print(
                f"[{spec.name}] prefill L={length} B={batch}: {case.tok_s:,.0f} tok/s "
                f"({case.median_s:.3f}s, {case.steps} steps)",
                flush=True,
            )
            cases.append(case)
    for batch in spec.decode_batches:
        case = Case("decode", args.decode_context, batch, tokens=batch * decode_steps, steps=decode_steps)
        for _ in range(reps):
            case.seconds.append(bench.decode(batch, decode_steps))
        print(f"[{spec.name}] decode B={batch}: {case.tok_s:,.1f} tok/s ({case.ms_per_step:.1f} ms/step)", flush=True)
        cases.append(case)
    mc = bench.core.model_config
    result = {
        "name": spec.name,
        "model": rel(spec.model),
        "load_format": spec.load_format,
        "family": mc.family,
        "params": bench.params,
        "dtype": args.dtype,
        "state_dtype": args.state_dtype,
        "load_seconds": bench.load_seconds,
        "kv_pages": bench.core.kv_pool.num_pages,
        "decode_steps": decode_steps,
        "kernels": bench.core.kernels.chosen,
        "cases": [c.to_json() for c in cases],
    }
    del bench
    gc.collect()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import torch

    if args.quick and args.threads is None:
        args.threads = 1  # robust on a shared machine; a smoke run is not about thread scaling
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (1 if args.quick else 3)
    specs = model_specs(args)
    started = utc_now()
    warning = busy_warning(
        "torch's OpenMP threads stall badly when the CPUs are oversubscribed; --threads 1 is more robust then."
    )
    if warning:
        print(warning, flush=True)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    results = [run_model(spec, args, reps) for spec in specs]
    machine = machine_info()
    payload = {
        "benchmark": "engine_cpu",
        "date_utc": started,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "settings": {
            "quick": args.quick,
            "reps": reps,
            "decode_context": args.decode_context,
            "page_size": args.page_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "dtype": args.dtype,
            "state_dtype": args.state_dtype,
            "sampling": "greedy, ignore_eos",
            "torch_threads": torch.get_num_threads(),
            "timed": "EngineCore.step() calls only; median of reps after one warm-up per model",
            "load_average_1m_start": load_start,
            "busy_warning": warning,
        },
        "models": results,
    }
    out = write_result(args.out, payload, machine)
    rows = []
    for m in results:
        if "skipped" in m:
            rows.append([m["name"], "skipped", "-", "-", "-", "-", "-", "-"])
            continue
        for c in m["cases"]:
            rows.append(
                [
                    m["name"],
                    c["phase"],
                    c["prompt_len"],
                    c["batch"],
                    c["tokens"],
                    c["seconds_median"],
                    c["tokens_per_s"],
                    c["ms_per_step"],
                ]
            )
    print()
    print(
        f"engine_cpu  {started}  {machine['cpu_model']}  {machine['cpus_usable']} CPUs  "
        f"torch {machine['torch']} ({machine['torch_threads']} threads)  -> {out}"
    )
    print(table(["model", "phase", "prompt", "batch", "tokens", "time s", "tok/s", "ms/step"], rows))
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())

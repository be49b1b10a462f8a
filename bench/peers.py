"""deltamesh next to vLLM on one GPU: the same dummy checkpoint and the same random load, one server after the
other, both driven by bench/serve.py through their OpenAI REST endpoints.

    python bench/peers.py --engines deltamesh,vllm --out bench/results/peers.json       # everything, in order
    python bench/peers.py --engines vllm --out $OUT/peers_vllm.json                       # one engine per call
    python bench/peers.py --compare $OUT/peers_deltamesh.json $OUT/peers_vllm.json        # the side-by-side table

deltamesh runs colocated (`deltamesh serve --colocated`, one worker, CUDA graphs, async scheduling). vLLM runs
from its own package folder (`--vllm-site`, see ../shared/notes/peers-on-h200.md for staging it on the H200 host)
with its defaults for this model plus `--load-format dummy --gdn-prefill-backend triton` (its FlashInfer GDN
prefill would JIT-compile with nvcc for minutes). The model folder each server gets is the shape's config.json
plus the default model's tokenizer (random-token prompts need only a vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.arrival_gap import first_wave
from bench.common import (
    CONFIGS,
    RESULTS,
    ROOT,
    exit_on_sigterm,
    fmt,
    free_port,
    ints,
    stop_group,
    table,
    with_tokenizer,
    write_result,
)
from bench.disagg_sweep import run_point, serve_command, wait_ready
from bench.server_side import PointObserver, metrics_urls


def start(engine: str, folder: Path, args, log: Path) -> tuple[subprocess.Popen, str, str]:
    """(process, base URL, readiness URL) of one server on GPU 0."""
    port = free_port()
    max_len = max(i + o for i, o in args.loads) + 16
    env = dict(os.environ)
    if engine == "deltamesh":
        cmd = serve_command(
            str(folder),
            port,
            max_len,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            colocated=True,
            extra=args.deltamesh_flag,
        )
        ready = f"http://127.0.0.1:{port}/ready"
    else:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(folder),
            "--served-model-name",
            folder.name,
            "--port",
            str(port),
            "--load-format",
            "dummy",
            "--language-model-only",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(max_len),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--gpu-memory-utilization",
            "0.90",
            "--gdn-prefill-backend",
            "triton",
        ]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.vllm_site, env.get("PYTHONPATH")]))
        env.update(HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0", CUDA_VISIBLE_DEVICES="0")
        ready = f"http://127.0.0.1:{port}/v1/models"
    # vLLM starts outside the repository, so that no top-level folder of ours can shadow a package it imports
    cwd = ROOT if engine == "deltamesh" else log.parent
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, f"http://127.0.0.1:{port}", ready


def measure(engine: str, shape: Path, args) -> list[dict]:
    work = Path(args.log_dir)
    folder = with_tokenizer(shape, work)
    log = work / f"peers-{engine}-{shape.name}.log"
    proc, base, ready = start(engine, folder, args, log)
    rows = []
    try:
        wait_ready(proc, ready, log, args.ready_timeout)
        observer = PointObserver(proc.pid, [f"{base}/metrics", *metrics_urls(log)])
        for input_len, output_len in args.loads:
            for c in args.concurrency:
                result = work / f"peers-{engine}-{shape.name}-{input_len}-{output_len}-c{c}.json"
                row = run_point(
                    base,
                    str(folder),
                    input_len,
                    output_len,
                    c,
                    max(args.waves * c, args.min_prompts),
                    result,
                    args.point_timeout,
                    observer=observer,
                    serve_args=args.serve_args.split(),
                )
                if engine == "deltamesh" and result.is_file():  # when the router started each request of wave 1
                    time.sleep(0.5)  # its last request lines, written as their streams closed
                    row.update(first_wave(result, log) or {})
                rows.append({"engine": engine, "shape": shape.name, "load": f"{input_len}/{output_len}", **row})
                print(rows[-1], flush=True)
    finally:
        stop_group(proc)
    return rows


def side_by_side(rows: list[dict]) -> str:
    """One line per (shape, load, concurrency): each engine's figures and deltamesh / vLLM."""
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_point.setdefault((r["shape"], r["load"], r["concurrency"]), {})[r["engine"]] = r
    lines = []
    for (shape, load, c), engines in by_point.items():
        d, v = engines.get("deltamesh", {}), engines.get("vllm", {})
        ratio = d.get("total_tok_s_per_gpu", 0) / v["total_tok_s_per_gpu"] if v.get("total_tok_s_per_gpu") else None
        lines.append(
            [shape, load, c]
            + [
                fmt(e.get(k))
                for e in (d, v)
                for k in ("total_tok_s_per_gpu", "ttft_median_ms", "tpot_median_ms", "tpot_p99_ms")
            ]
            + [fmt(ratio)]
        )
    heads = (
        ["shape", "load", "conc."]
        + [f"{e} {k}" for e in ("deltamesh", "vLLM") for k in ("tok/s/GPU", "TTFT", "TPOT", "TPOT p99")]
        + ["ratio"]
    )
    return table(heads, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=lambda s: s.split(","), default=["deltamesh", "vllm"])
    p.add_argument(
        "--shapes",
        type=lambda s: s.split(","),
        default=["qwen3.5-35b-a3b", "qwen3.5-9b"],
        help="folders under bench/configs",
    )
    p.add_argument(
        "--loads",
        type=lambda s: [tuple(ints(x.replace(":", ","))) for x in s.split(",")],
        default=[(8192, 1024), (1024, 1024)],
        help="input:output tokens, e.g. 8192:1024,1024:1024",
    )
    p.add_argument("--concurrency", type=ints, default=[1, 16, 64])
    p.add_argument("--waves", type=int, default=2, help="requests per point = waves x concurrency ...")
    p.add_argument("--min-prompts", type=int, default=4, help="... and at least this many")
    p.add_argument("--max-num-seqs", type=int, default=64)
    # 8192, vLLM's own budget here: at 16,384 a mixed step gives two 8k prompts their first tokens per ~440 ms
    # instead of one per ~220 ms, and the later arrivals' TTFT rose 2x (bench/RESULTS.md, "First tokens under load
    # on one H100"); the earlier tables ran at 16,384
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="deltamesh's step budget")
    p.add_argument("--vllm-site", default="/tmp/vllm-site", help="vLLM's own package folder, first on its PYTHONPATH")
    p.add_argument("--ready-timeout", type=float, default=420)
    p.add_argument("--point-timeout", type=float, default=300)
    p.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp"))
    p.add_argument(
        "--serve-args",
        default="",
        help="more flags of bench/serve.py for every point, e.g. sampling on every request: "
        "--serve-args='--presence-penalty 1.5 --frequency-penalty 0.5 --repetition-penalty 1.1'",
    )
    p.add_argument(
        "--deltamesh-flag",
        action="append",
        default=[],
        help="one more flag of `deltamesh serve` (repeatable), e.g. --deltamesh-flag=--quantization=fp8",
    )
    p.add_argument("--compare", nargs="+", help="print the side-by-side table of earlier runs' JSON and exit")
    p.add_argument("--out", default=str(RESULTS / "peers.json"))
    args = p.parse_args()
    exit_on_sigterm()
    if args.compare:
        rows = [r for f in args.compare for r in json.loads(Path(f).read_text())["rows"]]
        print(side_by_side(rows))
        return
    rows = [r for shape in args.shapes for engine in args.engines for r in measure(engine, CONFIGS / shape, args)]
    print(side_by_side(rows))
    write_result(args.out, {"benchmark": "peers", "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

"""Disaggregated (1 prefill worker + 1 decode worker) vs colocated (1 worker) serving at 8192 input / 1024 output
tokens, over a concurrency sweep, through the REST gateway with bench/serve.py. Each worker takes
`--gpus-per-worker` GPUs (its ranks: pass the layout with --serve-flag), so the disaggregated mesh needs twice
that many; with --one-gpu both workers share GPU 0, each in its share of it (--prefill-share, --decode-share), and
the colocated worker gets their sum (the same memory).

    python bench/disagg_sweep.py --out bench/results/serve_sweep.json
    python bench/disagg_sweep.py --setups colocated --concurrency 8,16 --out /tmp/colocated.json
    python bench/disagg_sweep.py --gpus-per-worker 2 --serve-flag=--data-parallel-size=2 \
        --serve-flag=--enable-expert-parallel --model bench/configs/qwen3.5-35b-a3b   # make bench-disagg-parallel
    python bench/disagg_sweep.py --one-gpu --shapes 8192/1024,1024/1024 --concurrency 1,16,64   # gpu_stage.sh 1

Each point sends `--waves x concurrency` requests with at most `concurrency` in flight. Per GPU figures
divide each mesh's throughput by the GPUs it uses. Each 1P+1D row also gives the state pulls of its point, from the
decode worker's "state received" log lines (count, median and p99 time, median size).
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

from bench.common import (
    CONFIGS,
    RESULTS,
    ROOT,
    exit_on_sigterm,
    free_port,
    ints,
    median,
    print_table,
    stop_group,
    write_result,
)
from bench.serve_metrics import wave_ttfts
from bench.server_side import PointObserver, metrics_urls


def serve_command(
    model: str,
    http_port: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    colocated: bool,
    extra: list[str] = (),
    gpus_per_worker: int = 1,
    shares: tuple[float, float] | None = None,
) -> list[str]:
    """`deltamesh serve` on dummy bf16 weights: colocated on the first `gpus_per_worker` GPUs, or 1P+1D on twice
    as many; `shares` (prefill, decode): both on GPU 0, each with that --gpu-memory-utilization, the colocated
    worker with their sum. Logged at info, so that the log shows the engine's periodic "engine steps" lines."""
    cmd = [
        sys.executable,
        "-m",
        "deltamesh.services.cli",
        "serve",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--grpc-port",
        str(free_port()),
        "--control-port",
        str(free_port()),
        "--http-port",
        str(http_port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
        "--no-ucx-error-handling",
        "--log-level",
        "info",
        *extra,
    ]
    if shares is not None:
        prefill, decode = shares
        budget = [f"--prefill-gpu-memory-utilization={prefill:g}", f"--decode-gpu-memory-utilization={decode:g}"]
        if colocated:
            budget = [f"--gpu-memory-utilization={prefill + decode:g}"]
        return cmd + budget + (["--colocated", "--decode-workers", "1"] if colocated else []) + ["--gpus", "0"]
    gpus = ",".join(str(g) for g in range(gpus_per_worker * (1 if colocated else 2)))
    return cmd + (["--colocated", "--decode-workers", "1"] if colocated else []) + ["--gpus", gpus]


def pull_stats(log: Path, offset: int) -> dict:
    """The decode worker's state pulls logged in `log` past byte `offset` (a point's requests and bench/serve.py's
    test request): count, median / p99 time, median size."""
    seconds, sizes = [], []
    with log.open("rb") as f:
        f.seek(offset)
        for line in f:
            if b'"state received"' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            seconds.append(entry["seconds"])
            sizes.append(entry["bytes"])
    if not seconds:
        return {"pulls": 0}
    seconds.sort()
    return {
        "pulls": len(seconds),
        "pull_ms_median": 1000 * median(seconds),
        "pull_ms_p99": 1000 * seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))],
        "pull_mib_median": median(sizes) / 2**20,
    }


def start_mesh(args, colocated: bool) -> tuple[subprocess.Popen, int, Path]:
    http_port = free_port()
    log = Path(args.log_dir) / f"serve-{'colocated' if colocated else 'disagg'}.log"
    cmd = serve_command(
        args.model,
        http_port,
        max(i + o for i, o in args.shapes) + 16,
        max(args.concurrency),
        args.max_num_batched_tokens,
        colocated,
        args.serve_flag,
        args.gpus_per_worker,
        (args.prefill_share, args.decode_share) if args.one_gpu else None,
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, http_port, log


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    """Until `url` answers 200 (a deltamesh router's /ready; vLLM's /v1/models, which it serves only when ready)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout:g} s:\n{log.read_text()[-4000:]}")


def run_point(
    base_url: str,
    model_dir: str,
    input_len: int,
    output_len: int,
    concurrency: int,
    num_prompts: int,
    result_file: Path,
    timeout: float,
    gpus: int = 1,
    observer: PointObserver | None = None,
    serve_args: list[str] = (),
    warmups: int = 1,
) -> dict:
    """One load point with bench/serve.py (random prompts, one warm-up request): per-GPU throughput, TTFT and
    TPOT, or {"error": ...}. Each point draws its own prompts (a seed of its own), so that points run one after
    another on one server never reuse each other's prompts through its prefix cache. `observer`: the server
    side's figures of the point (bench/server_side.py) go into the row too. `serve_args`: more flags of
    bench/serve.py (sampling on every request: --presence-penalty 1.5 ...)."""
    seed = (input_len * 1_000_003 + output_len) * 1_009 + concurrency
    cmd = [
        sys.executable,
        "bench/serve.py",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--model-dir",
        model_dir,
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--disable-tqdm",
        "--result-file",
        str(result_file),
        "--num-warmups",
        str(warmups),
        "--seed",
        str(seed),
        *serve_args,
    ]
    if observer is not None:
        observer.start()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"concurrency": concurrency, "error": f"point not done within {timeout:g} s"}
    server = observer.finish() if observer is not None else {}
    if done.returncode != 0 or not result_file.is_file():
        return {"concurrency": concurrency, "error": (done.stderr or done.stdout)[-800:]}
    raw = json.loads(result_file.read_text())
    m = raw.get("metrics", raw)
    return {
        "concurrency": concurrency,
        "completed": m["completed"],
        "failed": m["failed"],
        "total_tok_s_per_gpu": m["total_token_throughput"] / gpus,
        "output_tok_s_per_gpu": m["output_throughput"] / gpus,
        "ttft_median_ms": m["median_ttft_ms"],
        "ttft_p99_ms": m["p99_ttft_ms"],
        "tpot_median_ms": m["median_tpot_ms"],
        "tpot_p99_ms": m["p99_tpot_ms"],
        "ttft_mean_ms": m["mean_ttft_ms"],
        **wave_ttfts(raw.get("start_times", []), raw.get("ttfts", []), concurrency),
        **server,
    }


def sweep(args, colocated: bool, rows: list[dict]) -> None:
    """One setup's points, each row added to `rows` and written to --out as it comes (a sweep cut short by a time
    limit keeps the points it ran)."""
    proc, http_port, log = start_mesh(args, colocated)
    gpus = 1 if args.one_gpu else args.gpus_per_worker * (1 if colocated else 2)
    setup = f"colocated {gpus} GPU" if colocated else f"1P+1D {gpus} GPU{'s' if gpus > 1 else ''}"
    if args.one_gpu:
        both = args.prefill_share + args.decode_share
        setup += f" ({both:g})" if colocated else f" ({args.prefill_share:g} + {args.decode_share:g})"
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_ready(proc, f"{base}/ready", log)
        observer = PointObserver(proc.pid, [f"{base}/metrics", *metrics_urls(log)])
        first = True
        for input_len, output_len in args.shapes:
            for c in args.concurrency:
                name = f"serve-{'colo' if colocated else 'disagg'}-c{c}.json"
                if len(args.shapes) > 1:
                    name = name.replace(f"-c{c}", f"-{input_len}-{output_len}-c{c}")
                offset = log.stat().st_size
                row = run_point(
                    base,
                    args.model,
                    input_len,
                    output_len,
                    c,
                    args.waves * c,
                    Path(args.log_dir) / name,
                    args.point_timeout,
                    gpus,
                    observer,
                    warmups=0 if args.warm_once and not first else 1,
                )
                first = False
                if not colocated:
                    row.update(pull_stats(log, offset))
                rows.append(
                    {
                        "setup": setup,
                        "shape": f"{input_len}/{output_len}",
                        "max_num_batched_tokens": args.max_num_batched_tokens,
                        **row,
                    }
                )
                write_result(args.out, {"rows": rows})
                if "error" in row:
                    return
    finally:
        stop_group(proc)


def shapes(text: str) -> list[tuple[int, int]]:
    """ "8192/1024,1024/1024": (input, output) token counts."""
    return [tuple(int(n) for n in pair.split("/")) for pair in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CONFIGS / "qwen3.5-9b"))
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--concurrency", type=ints, default=[8, 16, 32, 64, 128])
    p.add_argument("--waves", type=int, default=1)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=16384,
        help="token budget of one engine step: how much prefill a step may carry beside its decodes",
    )
    p.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        help="extra flag for `deltamesh serve` (repeatable), e.g. --serve-flag=--no-async-scheduling",
    )
    p.add_argument("--gpus-per-worker", type=int, default=1, help="each worker's ranks (its layout via --serve-flag)")
    p.add_argument(
        "--shapes", type=shapes, help="input/output token pairs, e.g. 8192/1024,1024/1024 (default: the lengths)"
    )
    p.add_argument(
        "--one-gpu",
        action="store_true",
        help="1P+1D on GPU 0, each worker in its share; the colocated worker gets their sum",
    )
    p.add_argument("--prefill-share", type=float, default=0.45, help="--one-gpu: the prefill worker's fraction")
    p.add_argument("--decode-share", type=float, default=0.45, help="--one-gpu: the decode worker's fraction")
    p.add_argument("--warm-once", action="store_true", help="one warm-up request per server, not per point")
    p.add_argument("--point-timeout", type=float, default=300)
    p.add_argument(
        "--setups",
        type=lambda s: s.split(","),
        default=["disagg", "colocated"],
        help="disagg (1P+1D), colocated (one worker), or both",
    )
    p.add_argument("--log-dir", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--out", default=str(RESULTS / "serve_sweep.json"))
    args = p.parse_args()
    exit_on_sigterm()
    args.shapes = args.shapes or [(args.input_len, args.output_len)]
    rows = []
    for setup in args.setups:
        sweep(args, setup == "colocated", rows)
    cols = [
        "setup",
        "shape",
        "concurrency",
        "completed",
        "failed",
        "total_tok_s_per_gpu",
        "output_tok_s_per_gpu",
        "ttft_median_ms",
        "ttft_p99_ms",
        "tpot_median_ms",
        "tpot_p99_ms",
        "pulls",
        "pull_ms_median",
        "pull_ms_p99",
        "error",
    ]
    print_table(rows, cols)


if __name__ == "__main__":
    main()

"""bench/serve.py against a real mesh (router + REST gateway + prefill + decode processes on loopback): every
backend completes every request with exactly the requested output tokens, the metrics are sane and saved,
the script runs from the command line, and Ctrl-C cancels what is in flight. No timing assertions."""

import asyncio
import json
import math
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import ROOT, start_mesh

from bench import serve
from deltamesh.engine import DEFAULT_MODEL

pytestmark = pytest.mark.e2e

N, INPUT_LEN, OUTPUT_LEN, RANGE = 8, 32, 8, 0.25
METRIC_KEYS = [
    "duration",
    "completed",
    "failed",
    "not_sent",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99")),
    "input_lens",
    "output_lens",
    "expected_output_lens",
    "ttfts",
    "tpots",
    "itls",
    "latencies",
    "start_times",
    "errors",
    "date",
    "command",
    "machine",
    "config",
    "model",
]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = start_mesh(str(DEFAULT_MODEL), tmp_path_factory.mktemp("bench-mesh"), http=True)
    yield m
    m.stop()


def bench_args(mesh, backend, result_file, *extra):
    return [
        "--backend",
        backend,
        "--base-url",
        f"http://127.0.0.1:{mesh.http_port}",
        "--grpc-address",
        mesh.router_address,
        "--model-dir",
        str(DEFAULT_MODEL),
        "--num-prompts",
        str(N),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--range-ratio",
        str(RANGE),
        "--max-concurrency",
        "4",
        "--seed",
        "1",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--disable-tqdm",
        "--quiet",
        "--result-file",
        str(result_file),
        *extra,
    ]


def check_result(result, backend):
    assert result["completed"] == N and result["failed"] == 0 and result["not_sent"] == 0, result["errors"]
    assert not result["interrupted"]
    lo, hi = int(OUTPUT_LEN * (1 - RANGE)), int(OUTPUT_LEN * (1 + RANGE))
    assert all(lo <= n <= hi for n in result["expected_output_lens"])
    assert result["output_lens"] == result["expected_output_lens"]  # ignore_eos held every length
    assert result["total_output_tokens"] == sum(result["expected_output_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    if backend == "openai-chat":  # text prompts: the server's count, chat template included
        assert all(n > 0 for n in result["input_lens"])
    else:  # token-id prompts: exact
        assert all(int(INPUT_LEN * (1 - RANGE)) <= n <= int(INPUT_LEN * (1 + RANGE)) for n in result["input_lens"])
    assert all(t > 0 for t in result["ttfts"])
    assert all(t >= 0 for t in result["tpots"])
    assert all(e >= t for e, t in zip(result["latencies"], result["ttfts"]))
    assert all(len(itl) >= 1 and all(x >= 0 for x in itl) for itl in result["itls"])
    for key in (
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "mean_ttft_ms",
        "mean_e2el_ms",
        "duration",
    ):
        assert result[key] > 0, key
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs of a minute
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"mean_{m}_ms"] >= 0 and result[f"std_{m}_ms"] >= 0
        assert result[f"median_{m}_ms"] <= result[f"p90_{m}_ms"] <= result[f"p99_{m}_ms"]
    # the summary agrees with the per-request arrays (vLLM's definitions)
    tpots = [(e - t) / (n - 1) for e, t, n in zip(result["latencies"], result["ttfts"], result["output_lens"])]
    assert result["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert result["mean_ttft_ms"] == pytest.approx(1000 * np.mean(result["ttfts"]))
    assert result["p99_itl_ms"] == pytest.approx(1000 * np.percentile([x for i in result["itls"] for x in i], 99))
    assert result["max_concurrent_requests"] <= 4


@pytest.mark.parametrize("backend", serve.BACKENDS)
def test_each_backend_completes_every_request_with_exact_lengths(mesh, tmp_path, backend):
    path = tmp_path / f"{backend}.json"
    result = asyncio.run(serve.run_benchmark(serve.parse_args(bench_args(mesh, backend, path))))
    check_result(result, backend)
    saved = json.loads(path.read_text())
    for key in METRIC_KEYS:
        assert key in saved, key
    assert saved["config"]["backend"] == backend and saved["config"]["request_rate"] == "inf"
    assert saved["machine"]["cpu_count"] >= 1 and saved["model"] == DEFAULT_MODEL.name
    assert saved["completed"] == N and saved["output_lens"] == result["output_lens"]
    assert "T" in saved["date"] and saved["date"].endswith("+00:00")
    assert mesh.wait_idle() == {}


def test_command_line_with_poisson_arrivals_prints_the_table(mesh, tmp_path):
    path = tmp_path / "cli.json"
    args = bench_args(mesh, "openai", path, "--request-rate", "20", "--burstiness", "0.5")
    args.remove("--quiet")
    proc = subprocess.run(
        [sys.executable, "bench/serve.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    for label in (
        "Serving Benchmark Result",
        "Successful requests:",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P99 TPOT (ms):",
        "Median ITL (ms):",
        "P90 E2EL (ms):",
    ):
        assert label in proc.stdout, label
    saved = json.loads(path.read_text())
    check_result(saved, "openai")
    assert saved["command"][1:] == args and saved["config"]["request_rate"] == 20.0
    assert sorted(saved["start_times"]) == saved["start_times"]  # issued in order, on the schedule


def test_module_entry_point_reports_argument_errors():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serve", "--range-ratio", "1.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--range-ratio" in proc.stderr


def test_ctrl_c_stops_issuing_and_cancels_in_flight_requests(mesh, tmp_path):
    path = tmp_path / "interrupted.json"
    args = bench_args(
        mesh,
        "openai",
        path,
        "--num-prompts",
        "400",
        "--output-len",
        "2000",
        "--request-rate",
        "4",
        "--ready-check-timeout",
        "0",
    )
    args.remove("--quiet")
    proc = subprocess.Popen(
        [sys.executable, "bench/serve.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stderr:  # the measured run has started
            if line.startswith("Traffic request rate"):
                break
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(w.load().running for w in mesh.workers("decode")) == 0:
            time.sleep(0.1)  # wait until some request is decoding
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Interrupted (Ctrl-C):" in out
    saved = json.loads(path.read_text())
    assert saved["interrupted"] and saved["completed"] < 400 and saved["not_sent"] > 0 and saved["failed"] > 0
    assert "cancelled (interrupted)" in saved["errors"] and "not sent" in saved["errors"]
    assert saved["completed"] + saved["failed"] + saved["not_sent"] == 400
    assert math.isfinite(saved["duration"])
    assert mesh.wait_idle(timeout=30) == {}  # the cancelled requests were aborted in the mesh

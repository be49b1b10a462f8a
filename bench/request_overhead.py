"""Where a short request's time goes outside the engine: the same prompt, one request at a time, through the
engine in this process, through the router's gRPC API (the SDK) and through the REST gateway, against a
`deltamesh serve` mesh started here (colocated by default, or disaggregated with `--disaggregated`).

    python bench/request_overhead.py --out bench/results/request_overhead.json
    python bench/request_overhead.py --disaggregated --prompt-tokens 512 --max-tokens 8

Prints the median and p90 wall time per path and writes them as JSON with the command and the machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, free_port, median, print_table, stop_group, write_result
from bench.disagg_sweep import wait_ready


def timed(fn, n: int) -> list[float]:
    fn()  # warm-up: connections, first compilations
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def summary(path: str, times: list[float]) -> dict:
    times = sorted(times)
    return {
        "path": path,
        "requests": len(times),
        "median_ms": median(times),
        "p90_ms": times[int(0.9 * (len(times) - 1))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument(
        "--disaggregated", action="store_true", help="one prefill and one decode worker (default: colocated)"
    )
    p.add_argument("--out", default=str(RESULTS / "request_overhead.json"))
    args = p.parse_args()

    import httpx

    from deltamesh.client import Client
    from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams

    prompt = [5 + i % 200 for i in range(args.prompt_tokens)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    with Engine(EngineConfig(model=str(DEFAULT_MODEL), device="cpu", prefix_cache=False)) as engine:
        rows.append(summary("engine (in process)", timed(lambda: engine.generate([prompt], params), args.requests)))

    grpc_port, http_port, control_port = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "deltamesh.services.cli",
        "serve",
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--control-port",
        str(control_port),
        "--no-prefix-cache",
    ]
    cmd += [] if args.disaggregated else ["--colocated"]
    log = Path(args.out).with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(server, f"http://127.0.0.1:{http_port}/ready", log, 180)
        client = Client(f"127.0.0.1:{grpc_port}")
        kw = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        rows.append(summary("router gRPC (SDK)", timed(lambda: client.generate(prompt, **kw), args.requests)))
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }

            def rest(stream: bool):
                r = http.post("/v1/completions", json=body | {"stream": stream})
                r.raise_for_status()
                r.read()

            rows.append(summary("REST /v1/completions", timed(lambda: rest(False), args.requests)))
            rows.append(summary("REST, streamed", timed(lambda: rest(True), args.requests)))
    finally:
        stop_group(server)
    print_table(rows, ["path", "requests", "median_ms", "p90_ms"])
    write_result(
        args.out,
        {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "setup": "disaggregated" if args.disaggregated else "colocated",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()

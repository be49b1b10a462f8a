"""State transfer benchmark: how fast one request's hybrid state (full-attention KV pages + GDN conv and
recurrent state) moves from a prefill-like holder process to a decode-like puller process through the transport
API (transfer.StateHolder / transfer.StatePuller, over UCX), on loopback.

    .venv/bin/python bench/transfer.py                                  # 9B shape, 128 .. 8k tokens, both modes
    .venv/bin/python bench/transfer.py --quick                          # smoke run
    .venv/bin/python bench/transfer.py --model-config bench/configs/qwen3.5-35b-a3b --lengths 1024,4096

Per UCX mode (error handling on: UCX must be able to report a dead peer, which on a CPU host means TCP over
`lo`; off: UCX may use shared memory / CMA between the two processes), two fresh processes (bench/transfer_sides.py).
The holder seeds a request's pages and slot with random bytes, checksums them (CRC32; on GPUs a sum on the device)
and offers them under a lease; the lease key, transport descriptor and region sizes reach the puller through the
parent. The puller pulls into its own (zeroed) pools and checks the checksum before anything is reported; the
holder confirms the lease ended as "pulled".

Each length runs --reps + 1 pulls; the first is left out of the medians and reported apart (the first pull from
a peer pays UCX's set-up, which --warm does before it, as a decode worker does). Seconds are the puller's own
(called -> every segment received and the lease word checked, endpoint reuse included as in a running worker).
Baselines (bench/transfer_floors.py): a single-threaded torch copy of the same bytes in one process, or with
--device cuda a raw GPU 0 -> GPU 1 copy, back to back and after each pause of --gap-ms (or 20 ms). --floor adds
UCX's own floors (bare tag messages; the bare RMA reads a pull posts, spinning, back to back and after a pause,
and through the event loop). --in-flight N pulls N requests at once, --sequence N pulls N in a row, --gap-ms G
leaves the GPUs idle G ms before each pull. --overlap-model DIR runs a real engine loop on a thread, as a worker
does, and reports its step times before the first pull vs during pulls (bench/transfer_overlap.py): a decode
loop in the puller, or with --overlap-side prefill a prefill loop in the holder (whose event loop takes the
notices, and over TCP serves the reads); --offers-first has the holder prepare every state before that loop
starts, so none of the benchmark's own GPU work runs beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import busy_warning, command_line, machine_info, rel, utc_now, write_json
from bench.transfer_floors import FLOORS, after_idle
from bench.transfer_report import print_report
from bench.transfer_runs import PHASES, run_all
from bench.transfer_sides import PAGE_SIZE

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["FLOORS", "PHASES", "after_idle", "main"]


def tokens(s: str) -> int:
    """A token count: 4096, 4k (= 4096) or 0.5k."""
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def ints(s: str) -> list[int]:
    return [tokens(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-config",
        default=str(ROOT / "bench" / "configs" / "qwen3.5-9b"),
        help="directory with the model's config.json (default: bench/configs/qwen3.5-9b)",
    )
    p.add_argument("--lengths", type=ints, default=None, help="prompt lengths in tokens (default 128,1k,4k,8k,16k)")
    p.add_argument(
        "--max-tokens",
        type=tokens,
        default=8192,
        help="skip lengths above this (RAM: each of the two processes holds one request's state; default 8k)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed pulls per length after one warm-up (default 5)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "float16"],
        help="KV and conv state dtype (default bfloat16, as served on GPU)",
    )
    p.add_argument(
        "--state-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="GDN recurrent state dtype (default float32)",
    )
    p.add_argument(
        "--ucx-error-handling",
        dest="error_handling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run only this mode (default: both, one row each)",
    )
    p.add_argument(
        "--in-flight",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1],
        help="requests pulled at once, e.g. 1,4: their pulls overlap; a row per value (default 1)",
    )
    p.add_argument(
        "--sequence",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1],
        help="requests pulled one after another, back to back, e.g. 1,4: a row per value, timing every "
        "pull but the first of each turn (default 1; these rows pull one request at a time)",
    )
    p.add_argument(
        "--gap-ms",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0],
        help="comma list: idle milliseconds before each pull (each --sequence), the GPUs and the link "
        "untouched; a row per value (default 0). The raw GPU copy and the --floor RMA reads get an "
        "after-idle row per non-zero value (20 ms if none)",
    )
    p.add_argument(
        "--overlap-model",
        default=None,
        help="also run an engine loop of this model (a checkpoint, or a config dir: dummy weights) on a "
        "thread, as a worker does, and compare its step times before and during the pulls",
    )
    p.add_argument(
        "--overlap-side",
        choices=["decode", "prefill"],
        default="decode",
        help="decode: a decode loop in the puller (default); prefill: a prefill loop in the holder",
    )
    p.add_argument("--overlap-batch", type=int, default=8, help="requests in the engine loop's batch")
    p.add_argument(
        "--overlap-context",
        type=tokens,
        default=1024,
        help="decode: their context length; prefill: the prompt chunk each prefills per step",
    )
    p.add_argument(
        "--spin-ms",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[20.0],
        help="comma list: how long a GPU pull may spin on UCX progress (UcxPuller spin_s; 0: events only)",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="before the first pull, run the transport's warm-up (StatePuller.warm: a read of each of the "
        "holder's pools and of its lease words, a notice), as a decode worker does when a prefill "
        "worker joins; reported apart from the pulls",
    )
    p.add_argument(
        "--rotate",
        type=int,
        default=1,
        help="pull into this many places of the puller's pools in turn, as a decode worker's pulls land in "
        "pages that change from request to request (default 1: the same pages every time)",
    )
    p.add_argument(
        "--offers-first",
        action="store_true",
        help="the holder prepares every request's state before its engine loop starts (with --overlap-side "
        "prefill: then no seeding or summing by the benchmark runs beside the loop)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also move the same buffers with bare tag messages and with bare RMA reads, spinning on UCX "
        "progress (no lease, protocol or event loop): what UCX itself needs",
    )
    p.add_argument("--memcpy-threads", type=int, default=1, help="torch threads for the memcpy baseline")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per pull / lease TTL")
    p.add_argument("--ucx-proto-info", action="store_true", help="let UCX print its protocol choices (UCX_PROTO_INFO)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 and 1k tokens, 2 reps")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: pools on GPU 0 (holder) and GPU 1 (puller); baseline = raw peer copy",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "transfer_cpu.json"), help="JSON results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    max_tokens = args.max_tokens
    lengths = args.lengths or ([128, 1024] if args.quick else [128, 1024, 4096, 8192, 16384])
    skipped = [n for n in lengths if n > max_tokens]
    lengths = [n for n in lengths if n <= max_tokens]
    if not lengths:
        raise SystemExit(f"every length is above --max-tokens {max_tokens}")
    reps = args.reps or (2 if args.quick else 5)
    started = utc_now()
    warning = busy_warning()
    if warning:
        print(warning, flush=True)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    if skipped:
        print(f"skipping lengths above --max-tokens {max_tokens}: {skipped}", flush=True)
    rows, overlaps = run_all(args, lengths, reps)

    from deltamesh.engine.config import ModelConfig

    mc = ModelConfig.from_dir(args.model_config)
    try:
        import ucxx

        ucxx_version = ucxx.__version__
    except Exception:
        ucxx_version = None
    payload = {
        "benchmark": "transfer_cpu",
        "command": command_line(),
        "date_utc": started,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "machine": {**machine_info(), "ucxx": ucxx_version},
        "settings": {
            "model_config": rel(args.model_config),
            "family": mc.family,
            "full_attention_layers": len(mc.full_layers),
            "gdn_layers": len(mc.linear_layers),
            "page_size": PAGE_SIZE,
            "dtype": args.dtype,
            "state_dtype": args.state_dtype,
            "reps": reps,
            "warmup": 1,
            "lengths": lengths,
            "skipped_lengths": skipped,
            "ucx_net_devices": "lo",
            "memcpy_threads": args.memcpy_threads,
            "load_average_1m_start": load_start,
            "busy_warning": warning,
            "timed": "StatePuller.pull: called -> every segment received and the lease word checked; median of reps "
            "after 1 warm-up",
        },
        "results": rows,
        "overlap": overlaps,
    }
    out = write_json(args.out, payload)
    print()
    print(
        f"transfer_cpu  {started}  {Path(args.model_config).name} (KV {args.dtype}, GDN state {args.state_dtype})  "
        f"{payload['machine']['cpu_model']}  {payload['machine']['cpus_usable']} CPUs  -> {out}"
    )
    print_report(args, rows, overlaps)
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())

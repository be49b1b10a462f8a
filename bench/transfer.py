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
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    busy_warning,
    command_line,
    human_bytes,
    machine_info,
    median,
    rel,
    table,
    utc_now,
    write_json,
)
from bench.transfer_floors import (
    DEFAULT_PAUSE_S,
    FLOORS,
    after_idle,
    memcpy_baseline,
    peer_copy_baseline,
    result_row,
)
from bench.transfer_overlap import overlap_summary
from bench.transfer_sides import PAGE_SIZE, Options, expect, processes, state_sizes

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["FLOORS", "PHASES", "after_idle", "main"]

PHASES = {  # where a pull's time goes: (from, to) marks of the puller (p) and the holder (h), one clock
    "puller prepares": ("p.start", "p.keys"),
    "puller posts the reads": ("p.keys", "p.posted"),
    "reads posted -> seen done": ("p.posted", "p.reads"),
    "lease word read and checked": ("p.reads", "p.done"),
    "done notice reaches holder": ("p.done", "h.done"),
}


def phases(puller_marks: list[dict], holder_times: list[dict | None]) -> dict:
    """Milliseconds of each PHASES step, the worst over the requests pulled at once."""
    pulls = [
        {**{f"p.{k}": v for k, v in p.items()}, **{f"h.{k}": v for k, v in (h or {}).items()}}
        for p, h in zip(puller_marks, holder_times)
    ]
    out = {}
    for name, (a, b) in PHASES.items():
        spans = [(m[b] - m[a]) * 1e3 for m in pulls if a in m and b in m]
        out[name] = max(spans) if spans else None
    return out


def run_floor(opts: Options, lengths: list[int], reps: int, pauses: list[float]) -> list[dict]:
    """Rows per length: the state's buffers moved by bare tag messages and by bare RMA reads (spinning: back to
    back, and after each of `pauses`; through the event loop)."""
    rows, sizes = [], state_sizes(opts)
    with processes(opts) as (h_conn, p_conn):
        (holder_address,) = expect(h_conn, "ready", 120)
        (puller_address,) = expect(p_conn, "ready", 300)
        # every tag floor first: with error handling on, a tag floor run after an RMA floor to the same peer saw
        # its requests cancelled (not investigated further)
        kinds = [("tag", 0.0), ("rma", 0.0), *(("rma", pause) for pause in pauses), ("loop", 0.0)]
        for (kind, pause), (k, n_tokens) in ((kp, kn) for kp in kinds for kn in enumerate(lengths)):
            tag = 0x666C_6F6F_0000_0000 + (k << 20)  # "floo"
            h_conn.send(("floor", kind, n_tokens, reps, tag, puller_address))
            (regions,) = expect(h_conn, "floor-ready", 120)
            p_conn.send(("floor", kind, n_tokens, reps, tag, holder_address, regions, pause))
            secs, buffers = expect(p_conn, "floored", opts.timeout_s + 30)
            if kind != "tag":
                h_conn.send(("floor-done",))
            rows.append(
                result_row(
                    after_idle(FLOORS[kind], pause),
                    n_tokens,
                    *sizes(n_tokens),
                    secs,
                    error_handling=opts.error_handling,
                    idle_before_s=pause,
                    buffers=buffers,
                )
            )
            label = after_idle(kind, pause)
            print(f"[floor, {label}] {n_tokens} tokens: {rows[-1]['seconds_median'] * 1e3:.2f} ms", flush=True)
    return rows


class Offer(NamedTuple):
    """A state the holder prepared and offered under a lease, as the parent hears of it."""

    lease_id: str
    key: object  # transfer.LeaseKey
    descriptor: object  # its transport descriptor
    region_bytes: list[int]
    checksum: int
    kv_bytes: int
    gdn_bytes: int


class ModeRun:
    """The pull rows of one setting (UCX mode, pulls at once or in a row, spin, idle gap): a holder and a puller
    process, each length pulled --reps + 1 times; with opts.overlap_model, the engine loop's step times."""

    def __init__(self, opts: Options, lengths: list[int], reps: int, seed: int):
        self.lengths, self.reps, self.seed = lengths, reps, seed
        self.turns = [(n_tokens, rep) for n_tokens in lengths for rep in range(reps + 1)]
        # the holder sizes its pools for every turn it prepares up front
        self.opts = replace(opts, offers_first=len(self.turns) if opts.offers_first else 0)
        o = self.opts
        mode = "on" if o.error_handling else "off"
        self.spin = f", spin {o.spin_s * 1e3:g} ms" if o.device == "cuda" else ""
        self.label = f"eh-{mode}-x{o.in_flight}" + (f"-spin{o.spin_s * 1e3:g}" if self.spin else "")
        self.label += (f"-seq{o.sequence}" if o.sequence > 1 else "") + (f"-gap{o.gap_s * 1e3:g}" if o.gap_s else "")
        when = (f", {o.sequence} in a row: all but the first" if o.sequence > 1 else "") + (
            f", each {'sequence' if o.sequence > 1 else 'pull'} after {o.gap_s * 1e3:g} ms idle" if o.gap_s else ""
        )
        in_flight = f", {o.in_flight} pulls at once" if o.in_flight > 1 else ""
        self.mode = f"ucx error handling {mode}{in_flight}{self.spin}{when}"

    def run(self) -> tuple[list[dict], dict | None]:
        opts, rows, overlap = self.opts, [], None
        with processes(opts) as (self.h_conn, self.p_conn):
            expect(self.h_conn, "ready", 120)
            expect(self.p_conn, "ready", 300)
            # --offers-first: every turn's states, before the engine loop starts
            prepared = {turn: self._offers(*turn) for turn in self.turns} if opts.offers_first else {}
            self.h_conn.send(("start-loop",))
            if opts.overlap_model:
                time.sleep(opts.overlap_idle_s)  # the engine loop runs undisturbed: its baseline
            holder = self._announce()
            if opts.warm:
                self._warm(holder)
            for n_tokens in self.lengths:
                samples, first, info = [], None, {}
                for rep in range(self.reps + 1):
                    new, info = self._turn(n_tokens, prepared.pop((n_tokens, rep), None) or self._offers(n_tokens, rep))
                    if rep > 0:
                        samples += new[1:] if opts.sequence > 1 else new
                    else:  # reported apart: where the first pull from a peer spends its time
                        first = {"seconds": new[0]["seconds"], "phases": new[0]["phases"]}
                rows.append(self._row(n_tokens, samples, first, info))
            if opts.overlap_model:
                overlap = self._overlap()
        return rows, overlap

    def _offers(self, n_tokens: int, rep: int) -> list[Offer]:
        """The states of one turn (one or more requests), prepared and offered by the holder."""
        made, per_pull = [], self.opts.offers_per_pull
        for i in range(per_pull):
            lease_id = f"bench-{self.label}-{n_tokens}-{rep}-{i}"
            self.h_conn.send(("offer", lease_id, n_tokens, self.seed + rep * per_pull + i))
            made.append(Offer(lease_id, *expect(self.h_conn, "offered", self.opts.timeout_s)))
        return made

    def _announce(self):
        """The holder's description, announced to the puller as the router announces a mesh's holders (pullers
        refuse unannounced ones)."""
        self.h_conn.send(("pools",))
        (holder,) = expect(self.h_conn, "pools", 60)
        self.p_conn.send(("announce", holder))
        expect(self.p_conn, "announced", 60)
        return holder

    def _warm(self, holder) -> None:
        self.p_conn.send(("warm", holder))
        (warm_s,) = expect(self.p_conn, "warmed", self.opts.timeout_s + 30)
        print(f"[{self.label}] transport warmed in {warm_s * 1e3:.1f} ms", flush=True)
        time.sleep(0.5 if self.opts.overlap_model else 0)  # steps after the warm-up, before the first pull

    def _turn(self, n_tokens: int, made: list[Offer]) -> tuple[list[dict], dict]:
        """One turn's pulls, verified: (a sample per pull timed, the sizes seen)."""
        timeout_s = self.opts.timeout_s + 30
        self.p_conn.send(("pull", n_tokens, [(o.key, o.descriptor, o.region_bytes, o.checksum) for o in made]))
        (res,) = expect(self.p_conn, "pulled", timeout_s)
        reasons, holder_times = [], []
        for o in made:
            self.h_conn.send(("finish", o.lease_id))
            reason, times = expect(self.h_conn, "finished", timeout_s)
            reasons.append(reason)
            holder_times.append(times)
        if "error" in res:
            raise RuntimeError(f"pull of {n_tokens} tokens failed: {res['error']}")
        if not res["crc_ok"]:
            raise RuntimeError(f"pull of {n_tokens} tokens: received bytes differ from the sent ones")
        if set(reasons) != {"pulled"}:
            raise RuntimeError(f"leases ended as {reasons!r}, expected 'pulled'")
        info = {
            "kv_bytes": made[-1].kv_bytes,
            "gdn_bytes": made[-1].gdn_bytes,
            "holder_regions": len(made[-1].region_bytes),
            "puller_regions": res["puller_regions"],
            "buffers": res["buffers"],
        }
        if self.opts.sequence > 1:  # each pull its own sample but the first of each turn (it starts after a pause)
            return [
                {"seconds": x, "wall_seconds": x, "marks": [m], "phases": phases([m], [h])}
                for x, m, h in zip(res["pull_seconds"], res["marks"], holder_times)
            ], info
        return [{**res, "phases": phases(res["marks"], holder_times)}], info

    def _row(self, n_tokens: int, samples: list[dict], first: dict, info: dict) -> dict:
        o = self.opts
        secs = [s["seconds"] for s in samples]
        kv_bytes, gdn_bytes = info.pop("kv_bytes"), info.pop("gdn_bytes")
        total = (kv_bytes + gdn_bytes) * o.in_flight
        row = result_row(
            self.mode,
            n_tokens,
            kv_bytes,
            gdn_bytes,
            secs,
            nbytes=total,
            error_handling=o.error_handling,
            rotate=o.rotate,
            sequence=o.sequence,
            idle_before_s=o.gap_s,
            in_flight=o.in_flight,
            spin_ms=o.spin_s * 1e3 if self.spin else None,
            **info,
            wall_seconds=[s["wall_seconds"] for s in samples],
            marks_ms=[
                [{k: round((v - m["start"]) * 1e3, 4) for k, v in m.items()} for m in s["marks"]] for s in samples
            ],
            phases_ms_median={
                k: median([s["phases"][k] for s in samples if s["phases"][k] is not None]) for k in PHASES
            },
            first_pull=first,
            verified="crc32" if o.device == "cpu" else "position-weighted sum on the GPU",
        )
        print(
            f"[{self.label}] {n_tokens} tokens: {human_bytes(total)} in {row['seconds_median'] * 1e3:.2f} ms "
            f"= {row['gb_per_s']:.2f} GB/s, {info['buffers']} buffers",
            flush=True,
        )
        return row

    def _overlap(self) -> dict:
        o = self.opts
        self.p_conn.send(("report",))
        self.h_conn.send(("report",))
        decode_steps, pulls, checks, warm_ups = expect(self.p_conn, "overlap", 300)
        prefill_steps, preps = expect(self.h_conn, "overlap", 300)
        # the benchmark's own GPU work beside the loop: checking pulled bytes (decode), seeding offers (prefill)
        if o.overlap_side == "decode":
            summary = overlap_summary(decode_steps, pulls, checks, warm_ups)
        else:
            summary = overlap_summary(prefill_steps, pulls, preps, warm_ups)
        return {
            "mode": self.label,
            "side": o.overlap_side,
            "model": rel(o.overlap_model),
            "batch": o.overlap_batch,
            "context": o.overlap_context,
            **summary,
        }


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


def run_all(args: argparse.Namespace, lengths: list[int], reps: int) -> tuple[list[dict], list[dict]]:
    """Every pull row (each UCX mode x spin x turn shape x gap), then the floors and the raw copy."""
    modes = [args.error_handling] if args.error_handling is not None else [True, False]
    base = Options(
        args.model_config,
        args.dtype,
        args.state_dtype,
        max(lengths),
        modes[0],
        args.timeout,
        args.ucx_proto_info,
        args.device,
        overlap_model=args.overlap_model,
        overlap_side=args.overlap_side,
        overlap_batch=args.overlap_batch,
        overlap_context=args.overlap_context,
        warm=args.warm,
        rotate=args.rotate,
        offers_first=args.offers_first,
    )
    rows, overlaps = [], []
    turns = [(n, 1) for n in args.in_flight] + [(1, n) for n in args.sequence if n > 1]  # (in flight, in a row)
    for eh in modes:
        for spin_ms in args.spin_ms if args.device == "cuda" else [0.0]:
            for (in_flight, sequence), gap_ms in ((turn, gap) for turn in turns for gap in args.gap_ms):
                opts = replace(
                    base,
                    error_handling=eh,
                    spin_s=spin_ms / 1e3,
                    in_flight=in_flight,
                    sequence=sequence,
                    gap_s=gap_ms / 1e3,
                )
                mode_rows, overlap = ModeRun(opts, lengths, reps, args.seed).run()
                rows += mode_rows
                overlaps += [overlap] if overlap else []
    plain = Options(
        args.model_config,
        args.dtype,
        args.state_dtype,
        max(lengths),
        modes[0],
        args.timeout,
        args.ucx_proto_info,
        args.device,
    )
    pauses = sorted({gap / 1e3 for gap in args.gap_ms if gap}) or [DEFAULT_PAUSE_S]  # the after-idle rows
    if args.floor:
        rows += run_floor(plain, lengths, reps, pauses)
    if args.device == "cuda":
        rows += peer_copy_baseline(state_sizes(plain), lengths, reps, pauses)
    else:
        rows += memcpy_baseline(state_sizes(plain), lengths, reps, args.memcpy_threads)
    return rows, overlaps


def print_report(args: argparse.Namespace, rows: list[dict], overlaps: list[dict]) -> None:
    print(
        table(
            ["mode", "tokens", "KV bytes", "GDN bytes", "buffers", "median ms", "mean ms", "GB/s"],
            [
                [
                    r["mode"],
                    r["tokens"],
                    human_bytes(r["kv_bytes"]),
                    human_bytes(r["gdn_bytes"]),
                    r["buffers"],
                    r["seconds_median"] * 1e3,
                    r["seconds_mean"] * 1e3,
                    r["gb_per_s"],
                ]
                for r in rows
            ],
        )
    )
    pulls = [r for r in rows if "phases_ms_median" in r]
    print("\nwhere a pull's time goes (median ms; one clock for both processes)")
    print(
        table(["mode", "tokens", *PHASES], [[r["mode"], r["tokens"], *r["phases_ms_median"].values()] for r in pulls])
    )
    print("\nthe dropped first pull of each row (ms)")
    firsts = [r["first_pull"] for r in pulls]
    print(
        table(
            ["mode", "tokens", "pull", *PHASES],
            [[r["mode"], r["tokens"], f["seconds"] * 1e3, *f["phases"].values()] for r, f in zip(pulls, firsts)],
        )
    )
    if not overlaps:
        return
    where = "a decode loop in the puller" if args.overlap_side == "decode" else "a prefill loop in the holder"
    own = "check of the pulled bytes" if args.overlap_side == "decode" else "seeding and summing of each offer"
    print(
        f"\n{where} (step ms): before the first pull vs steps that overlapped a pull (median / p99 / max);"
        f" apart: steps that overlapped a pull but not the benchmark's own {own}, and those that did"
    )

    def span(st: dict) -> str:
        return f"{st['median_ms']:.1f} / {st['p99_ms']:.1f} / {st['max_ms']:.1f}" if st["steps"] else "-"

    print(
        table(
            [
                "mode",
                "model",
                "batch",
                "context" if args.overlap_side == "decode" else "chunk",
                "idle steps",
                "idle",
                "during steps",
                "during pulls",
                "pull, no bench work",
                "during bench work",
            ],
            [
                [
                    o["mode"],
                    o["model"],
                    o["batch"],
                    o["context"],
                    o["idle"]["steps"],
                    span(o["idle"]),
                    o["during_pulls"]["steps"],
                    span(o["during_pulls"]),
                    span(o["during_pulls_not_checks"]),
                    span(o["during_checks"]),
                ]
                for o in overlaps
            ],
        )
    )
    longest = "longest step during it (ms)"
    print(
        table(
            ["mode", "warm-up ms", longest, "first pull ms", longest],
            [
                [
                    o["mode"],
                    ", ".join(map(str, o["warm_up_ms"])) or "-",
                    ", ".join(map(str, o["max_step_ms_per_warm_up"])) or "-",
                    o["pull_ms"][0],
                    o["max_step_ms_per_pull"][0],
                ]
                for o in overlaps
            ],
        )
    )


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

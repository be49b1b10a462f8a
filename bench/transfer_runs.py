"""bench/transfer.py's runs, the parent's side: for each setting (UCX mode, spin, pulls at once or in a row, idle
gap) a holder and a puller process (bench/transfer_sides.py) driven through their offers and verified pulls, one
row per length; then UCX's floors and the raw copy of the same bytes (bench/transfer_floors.py)."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import NamedTuple

from bench.common import human_bytes, median, rel
from bench.transfer_floors import (
    DEFAULT_PAUSE_S,
    FLOORS,
    after_idle,
    memcpy_baseline,
    peer_copy_baseline,
    result_row,
)
from bench.transfer_overlap import overlap_summary
from bench.transfer_sides import Options, expect, processes, state_sizes

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

"""Where a first token's time goes before the router sees the request: bench/serve.py's per-request JSON against
the router's "request" log lines of the same run (`--log-requests`, on in bench/peers.py's servers). Requests are
paired by the order they ended in; for each, `gap` is the client's TTFT less the router's (the REST gateway, the
client and the wire) and `arrival` when the router started it after the client sent it (the gateway's parsing and
checks; the router's clock starts at `Mesh.generate`). Rows by send time, summarised per wave (a wave: the requests
sent within a second of the first of its kind, e.g. bench/peers.py's first `concurrency` requests).

    python bench/arrival_gap.py $OUT/peers-deltamesh-qwen3.5-9b-8192-1024-c64.json $OUT/peers-deltamesh-qwen3.5-9b.log
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, median, print_table, write_result

CHAT_TEMPLATE_TOKENS = 256


def router_requests(log: Path, lens: list[int]) -> list[tuple[float, float, float]]:
    """(end time, seconds, ttft) of each of the router's request lines whose prompt length is the client's: within
    the client's lengths, or up to CHAT_TEMPLATE_TOKENS more (a chat's template adds its own tokens)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if '"event": "request"' not in line or '"router"' not in line:
            continue
        row = json.loads(line)
        n = row.get("prompt_tokens", -1)
        if min(lens) <= n <= max(lens) + CHAT_TEMPLATE_TOKENS and row.get("ttft_s") is not None:
            end = dt.datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append((end, row["seconds"], row["ttft_s"]))
    return sorted(out)


def pair(client: dict, router: list[tuple[float, float, float]]) -> list[dict]:
    sent = client["start_times"]
    ends = sorted(range(len(sent)), key=lambda i: sent[i] + client["latencies"][i])
    # the point's own requests: the log may hold other points' and a warm-up. Its report's date (whole seconds)
    # follows the last request's end; the point lasted `duration` seconds
    done = dt.datetime.fromisoformat(client["date"]).timestamp()
    router = [r for r in router if done - client["duration"] - 2 <= r[0] <= done + 1][-len(ends) :]
    if len(router) != len(ends):
        raise ValueError(f"{len(ends)} client requests but {len(router)} router lines of their prompt length")
    # the two clocks differ by a constant: the median of (router end - client end) over the pairs
    offset = median([r[0] - (sent[i] + client["latencies"][i]) for i, r in zip(ends, router, strict=True)])
    rows = []
    for i, (end, seconds, ttft) in zip(ends, router, strict=True):
        rows.append(
            dict(
                sent_s=round(sent[i], 3),
                client_ttft_ms=round(client["ttfts"][i] * 1e3, 1),
                router_ttft_ms=round(ttft * 1e3, 1),
                gap_ms=round((client["ttfts"][i] - ttft) * 1e3, 1),
                arrival_ms=round((end - seconds - offset - sent[i]) * 1e3, 1),
            )
        )
    return sorted(rows, key=lambda r: r["sent_s"])


def waves(rows: list[dict]) -> list[dict]:
    out: list[dict] = []
    for r in rows:
        if not out or r["sent_s"] - out[-1]["first_sent_s"] > 1.0:
            out.append(dict(first_sent_s=r["sent_s"], rows=[]))
        out[-1]["rows"].append(r)
    return [
        dict(
            first_sent_s=w["first_sent_s"],
            requests=len(w["rows"]),
            arrival_first_ms=w["rows"][0]["arrival_ms"],
            arrival_median_ms=round(median([r["arrival_ms"] for r in w["rows"]]), 1),
            arrival_max_ms=max(r["arrival_ms"] for r in w["rows"]),
            gap_median_ms=round(median([r["gap_ms"] for r in w["rows"]]), 1),
        )
        for w in out
    ]


def first_wave(client_json: Path, router_log: Path) -> dict | None:
    """The first wave's arrivals (first, median, last ms after sending), or None where the log does not pair."""
    client = json.loads(client_json.read_text())
    try:
        wave = waves(pair(client, router_requests(router_log, client["input_lens"])))[0]
    except (ValueError, KeyError, IndexError):
        return None
    return {f"arrival_wave1_{k}_ms": wave[f"arrival_{k}_ms"] for k in ("first", "median", "max")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("client_json", type=Path, help="bench/serve.py's --result-file of one point")
    ap.add_argument("router_log", type=Path, help="the router's log of the same run")
    ap.add_argument("--rows", action="store_true", help="print every request, not only the waves")
    ap.add_argument("--out", default=str(RESULTS / "arrival_gap.json"))
    args = ap.parse_args()
    client = json.loads(args.client_json.read_text())
    try:
        rows = pair(client, router_requests(args.router_log, client["input_lens"]))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.rows:
        print_table(rows, list(rows[0]))
    summary = waves(rows)
    print_table(summary, list(summary[0]))
    write_result(
        args.out, dict(client=str(args.client_json), router_log=str(args.router_log), waves=summary, rows=rows)
    )


if __name__ == "__main__":
    main()

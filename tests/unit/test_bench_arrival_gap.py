"""bench/arrival_gap.py: a point's client JSON paired with the router's request lines by end order, across the two
clocks, the log's other points and warm-up left out; arrivals per wave."""

import datetime as dt
import json

from bench.arrival_gap import first_wave, pair, router_requests, waves


def _line(end: float, seconds: float, ttft: float, prompt_tokens: int) -> str:
    stamp = dt.datetime.fromtimestamp(end, dt.UTC).isoformat().replace("+00:00", "Z")
    row = dict(prompt_tokens=prompt_tokens, ttft_s=ttft, seconds=seconds, event="request", service="router")
    return json.dumps(row | {"timestamp": stamp})


def test_arrivals_pair_by_end_order_across_clocks_and_leave_other_points_out(tmp_path):
    t0 = 1_800_000_000.0  # the router's clock at the client's start (the client's own clock reads 0 there)
    sent = [0.0, 0.01, 0.02, 5.0]  # a wave of three at once, then one more
    latency = [2.0, 2.1, 2.2, 1.0]
    ttft = [0.5, 0.6, 0.7, 0.2]
    delay = [0.1, 0.2, 0.3, 0.01]  # sent -> the router's start of it
    client = dict(
        start_times=sent,
        latencies=latency,
        ttfts=ttft,
        input_lens=[100] * 4,
        duration=6.0,
        date=dt.datetime.fromtimestamp(t0 + 7, dt.UTC).isoformat(timespec="seconds"),
    )
    (tmp_path / "c.json").write_text(json.dumps(client))
    lines = [
        _line(t0 - 60, 3.0, 0.3, 100),  # an earlier point's request: outside this point's window
        _line(t0 - 0.5, 0.2, 0.1, 5),  # the warm-up: another prompt length
    ]
    for s, lat, t, d in zip(sent, latency, ttft, delay, strict=True):
        end = t0 + s + lat
        lines.append(_line(end, lat - d, t - d, 100))
    (tmp_path / "router.log").write_text("\n".join(["not json: a plain line", *lines]) + "\n")

    rows = pair(client, router_requests(tmp_path / "router.log", client["input_lens"]))
    assert [r["arrival_ms"] for r in rows] == [100.0, 200.0, 300.0, 10.0]
    assert [r["gap_ms"] for r in rows] == [100.0, 200.0, 300.0, 10.0]  # the gateway and the wire, before the router
    first, second = waves(rows)
    assert (first["requests"], first["arrival_first_ms"], first["arrival_median_ms"], first["arrival_max_ms"]) == (
        3,
        100.0,
        200.0,
        300.0,
    )
    assert second["requests"] == 1 and second["first_sent_s"] == 5.0
    assert first_wave(tmp_path / "c.json", tmp_path / "router.log") == {
        "arrival_wave1_first_ms": 100.0,
        "arrival_wave1_median_ms": 200.0,
        "arrival_wave1_max_ms": 300.0,
    }
    (tmp_path / "router.log").write_text("\n".join(lines[:3]) + "\n")  # requests missing: no pairing, no figures
    assert first_wave(tmp_path / "c.json", tmp_path / "router.log") is None

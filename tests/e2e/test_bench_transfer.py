"""The side-channel benchmark runs end to end on a CPU host (two processes, real UCX): every pull verified,
each floor timed, the phases of a pull stamped, and the warm-up and engine loop beside the pulls reported."""

import json

import pytest

from bench import transfer

pytestmark = pytest.mark.e2e
# The states moved are those of the tiny model (hundreds of KiB) rather than the default Qwen3.5-9B's (about 50 MiB
# at 128 tokens): what is checked here (each pull verified, every row, floor and phase reported) does not depend on
# their size, and allocating, filling and checking the large ones cost several seconds a run.
TINY = ["--model-config", "models/deltamesh-tiny"]


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_transfer_bench_reports_pulls_floors_phases_and_overlap(tmp_path, side):
    out = tmp_path / "deltamesh.transfer.json"
    assert (
        transfer.main(
            [
                *TINY,
                "--lengths",
                "128",
                "--reps",
                "1",
                "--no-ucx-error-handling",
                "--floor",
                "--warm",
                "--rotate",
                "2",
                "--overlap-model",
                "models/deltamesh-tiny",
                "--overlap-side",
                side,
                "--overlap-batch",
                "2",
                "--overlap-context",
                "64",
                "--out",
                str(out),
                *(["--offers-first"] if side == "prefill" else []),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["results"]}
    pull = rows["ucx error handling off"]
    assert pull["verified"] == "crc32" and pull["buffers"] == 3 and len(pull["seconds"]) == 1
    assert all(v is not None and v >= 0 for v in pull["phases_ms_median"].values()), pull["phases_ms_median"]
    assert pull["first_pull"]["seconds"] > 0 and set(pull["first_pull"]["phases"]) == set(transfer.PHASES)
    assert set(transfer.FLOORS.values()) <= set(rows)  # tag, RMA spinning, RMA through the event loop
    (overlap,) = result["overlap"]
    assert overlap["side"] == side and overlap["pulls"] == 2 and overlap["idle"]["steps"] > 0
    assert len(overlap["warm_up_ms"]) == 1
    if side == "prefill":  # --offers-first: every state was prepared before the loop, none beside a pull
        assert overlap["during_pulls_not_checks"]["steps"] == overlap["during_pulls"]["steps"]


def test_transfer_bench_times_pulls_in_a_row_and_after_an_idle_gap(tmp_path):
    """--sequence 3: every pull of a turn but the first is timed (back to back, as the raw copy's first row);
    --gap-ms: the turn starts after that much idle time (as its second row), and the bare RMA reads of --floor
    are timed after the same pause too. Every pull verified."""
    out = tmp_path / "deltamesh.transfer.json"
    assert (
        transfer.main(
            [
                *TINY,
                "--lengths",
                "128",
                "--reps",
                "2",
                "--no-ucx-error-handling",
                "--sequence",
                "3",
                "--gap-ms",
                "5",
                "--floor",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())["results"]
    floor_after_idle = {r["mode"]: r for r in results}[transfer.after_idle(transfer.FLOORS["rma"], 0.005)]
    assert floor_after_idle["idle_before_s"] == 0.005 and len(floor_after_idle["seconds"]) == 2
    rows = [r for r in results if "phases_ms_median" in r]
    single, in_a_row = sorted(rows, key=lambda r: r["sequence"])
    assert single["idle_before_s"] == in_a_row["idle_before_s"] == 0.005
    assert len(single["seconds"]) == 2 and len(in_a_row["seconds"]) == 2 * 2  # 2 timed turns of 3, less the first
    assert all(r["verified"] == "crc32" for r in rows)
    assert "3 in a row" in in_a_row["mode"] and "after 5 ms idle" in single["mode"]

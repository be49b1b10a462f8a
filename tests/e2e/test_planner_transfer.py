"""`deltamesh profile` measuring state transfers the way a decode worker pulls from a prefill worker (bench/transfer.py:
a holder and a puller process over UCX), then `deltamesh plan` weighing prefill/decode layouts on that profile;
both run as the commands a user types."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
GRID = ["--prefill-lens", "16,64", "--prefill-batches", "1", "--decode-batches", "1,4", "--decode-contexts", "64"]
GRID += ["--decode-steps", "3", "--mixed", "", "--reps", "1", "--transfer-lens", "64,1024", "--torch-threads", "1"]


def deltamesh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deltamesh.services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_profile_with_measured_transfers_then_a_disaggregated_plan(tmp_path):
    profile = tmp_path / "tiny.json"
    done = deltamesh("profile", "--out", str(profile), *GRID)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(profile.read_text())
    points = data["transfer"]["points"]
    assert [int(t) for t, _ in points] == [64, 1024] and all(ms > 0 for _, ms in points)
    assert data["transfer"]["source"].startswith("bench/transfer.py: ucx error handling on")
    assert data["mixed_extra_ms"] == 0.0 and data["measurements"]["mixed"] == []  # --mixed '': none measured

    plan = tmp_path / "plan.json"
    args = ["--profile", str(profile), "--input-len", "64", "--output-len", "8", "--concurrency", "4"]
    args += ["--num-requests", "16", "--disaggregated-only", "--max-gpus", "3", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "256", "--json", str(plan)]
    done = deltamesh("plan", *args)
    assert done.returncode == 0, done.stderr
    winner = json.loads(plan.read_text())["winner"]
    assert winner["layout"]["label"] == "1P1D" and winner["summary"]["unfinished"] == 0
    assert "deltamesh serve --prefill-workers 1 --decode-workers 1" in done.stdout

"""State-transfer times for a profile: measured by the side channel's own benchmark (`bench/transfer.py`, a holder
and a puller process pulling a request's state over UCX, as a decode worker pulls from a prefill worker), or read
from a JSON it wrote earlier (e.g. on a host with two GPUs, for a profile made on one)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from deltamesh.planner.profile import FORMAT, Profile, ProfileError, TransferModel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "transfer.py"  # a checkout's; not installed with deltamesh


def from_file(path: str | Path) -> TransferModel:
    """Pull times from a `bench/transfer.py` JSON (its single, back-to-back pulls: one request at a time, no
    pause before it, the first pull of each length left out as the benchmark does), or from a profile."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"{path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON ({e})") from None
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return Profile.from_json(data, where=str(path)).transfer
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ProfileError(f'{path}: neither a profile nor a bench/transfer.py result (no "results" list)')
    points = sorted(
        [r["tokens"], r["seconds_median"] * 1e3]
        for r in rows
        if "phases_ms_median" in r
        and r.get("in_flight", 1) == 1
        and r.get("sequence", 1) == 1
        and not r.get("idle_before_s")
    )
    if not points:
        raise ProfileError(f"{path}: no single back-to-back pull rows in its results")
    mode = next(r["mode"] for r in rows if "phases_ms_median" in r)
    return TransferModel(points, f"{path.name}: {mode}")


def measure(
    model_dir: str, lengths: list[int], dtype: str, state_dtype: str, cuda: bool, error_handling: bool, reps: int
) -> TransferModel:
    """Run `bench/transfer.py` for the model's state at each length (CUDA: holder on GPU 0, puller on GPU 1)."""
    if not BENCH.is_file():
        raise ProfileError(
            f"measuring transfers runs {BENCH.relative_to(BENCH.parents[1])} of a deltamesh checkout, which is not "
            "here: give --transfer-from FILE (a bench/transfer.py JSON) or --no-transfer"
        )
    if cuda:
        import torch

        if torch.cuda.device_count() < 2:
            raise ProfileError(
                "measuring GPU transfers needs two GPUs (a pull from GPU 0 to GPU 1): give --transfer-from FILE (a "
                "bench/transfer.py --device cuda JSON from a host with two) or --no-transfer"
            )
    with tempfile.TemporaryDirectory(prefix="deltamesh-profile-") as tmp:
        out = Path(tmp) / "transfer.json"
        cmd = [
            sys.executable,
            str(BENCH),
            "--model-config",
            model_dir,
            "--lengths",
            ",".join(map(str, lengths)),
            "--max-tokens",
            str(max(lengths)),
            "--reps",
            str(reps),
            "--dtype",
            dtype,
            "--state-dtype",
            state_dtype,
            "--device",
            "cuda" if cuda else "cpu",
            "--ucx-error-handling" if error_handling else "--no-ucx-error-handling",
            "--out",
            str(out),
        ]
        done = subprocess.run(cmd, cwd=BENCH.parents[1], capture_output=True, text=True)
        if done.returncode != 0:
            raise ProfileError(f"bench/transfer.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
        model = from_file(out)
    return TransferModel(model.points, f"bench/transfer.py: {model.source.split(': ', 1)[-1]}")

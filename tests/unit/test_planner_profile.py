"""`deltamesh profile` on the embedded default model (a small grid, no transfers: those are measured by real UCX
processes in tests/e2e/test_planner_transfer.py), and `deltamesh plan` on the profile it writes. CPU timings on a
shared machine vary, so the checks are on what the profile must hold, not on its numbers."""

import json
import math

import pytest
from typer.testing import CliRunner

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.defaults import DEFAULT_MODEL
from deltamesh.planner.profile import Profile
from deltamesh.planner.transfer_times import from_file
from deltamesh.services.cli import app

GRID = ["--prefill-lens", "16,64", "--prefill-batches", "1,2", "--decode-batches", "1,4", "--decode-contexts", "32,128"]
GRID += ["--decode-steps", "3", "--mixed", "4:64:1:64", "--reps", "1"]


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    result = CliRunner().invoke(app, ["profile", "--out", str(path), *GRID, "--no-transfer", "--torch-threads", "1"])
    assert result.exit_code == 0, result.output
    return path


def test_profile_holds_every_measurement_and_its_fit(tiny_profile):
    p = Profile.load(tiny_profile)
    assert p.name == "deltamesh-tiny-cpu" and p.gpus_per_worker == 1 and p.engine["device"] == "cpu"
    # each context's points are filed at the context the ladder averaged (its requests grow a token a step)
    by_context = {}
    for b, c, _ in p.decode.points:
        by_context.setdefault(c, []).append(int(b))
    low, high = sorted(by_context)
    assert 32 < low < 128 < high < 128 + 40 and all(sorted(v) == [1, 4] for v in by_context.values())
    assert all(ms > 0 for *_, ms in p.decode.points)
    # a point is what its timed steps took end to end per step (their mean; one round here), not their median
    for row in p.measurements["decode"]:
        assert len(row["steps_ms"]) == 3 and row["ms"] == pytest.approx(sum(row["steps_ms"]) / 3)
    flows = p.measurements["prefill"]
    assert sorted((f["prompt_len"], f["batch"]) for f in flows) == [(16, 1), (16, 2), (64, 1), (64, 2)]
    assert all(f["steps"] >= 1 and f["ms"] > 0 for f in flows)
    assert len(p.fit_errors["prefill"]) == 4 and len(p.fit_errors["mixed"]) == 1
    pre = p.prefill
    assert all(math.isfinite(v) and v >= 0 for v in (pre.step_ms, pre.ms_per_token, pre.ms_per_mpair))
    assert pre.ms(64, 64 * 64 / 2) > 0
    (mixed,) = p.measurements["mixed"]
    assert mixed["steps"] >= 1 and mixed["decodes"] == 4
    assert p.transfer.points == [] and "--no-transfer" in p.transfer.source


def test_profile_memory_is_the_models(tiny_profile):
    p, mc = Profile.load(tiny_profile), ModelConfig.from_dir(DEFAULT_MODEL)
    fp32 = 4
    assert p.memory.kv_bytes_per_token == 2 * len(mc.full_layers) * mc.num_key_value_heads * mc.head_dim * fp32
    conv = mc.conv_dim * (mc.linear_conv_kernel_dim - 1)
    recurrent = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim
    assert p.memory.state_bytes == len(mc.linear_layers) * (conv + recurrent) * fp32
    assert p.memory.fixed_kv_budget_bytes == 2**30  # the engine's automatic KV pool on CPU
    # 1 GiB of pages, at most max_num_seqs requests at the full context
    assert p.memory.kv_capacity_tokens(4, 1000) == 4 * 1008
    assert p.memory.kv_capacity_tokens(10**6, 1000) == 2**30 // p.memory.kv_bytes_per_token


def test_profile_says_how_it_was_made(tiny_profile):
    data = json.loads(tiny_profile.read_text())
    prov = data["provenance"]
    assert prov["command"].startswith("deltamesh profile ") and "--decode-contexts" in prov["command"]
    assert prov["tree"]["commit"] and prov["date_utc"] and prov["machine"]["torch"]
    assert data["engine"]["torch_threads"] == 1 and data["model"]["name"] == "deltamesh-tiny"


def test_plan_on_the_profile(tiny_profile, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(tiny_profile), "--input-len", "uniform:32:96", "--output-len", "16"]
    args += ["--concurrency", "4", "--num-requests", "24", "--colocated-only", "--max-gpus", "2"]
    args += ["--max-num-seqs", "4,8", "--max-num-batched-tokens", "256", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    winner = data["winner"]  # no SLA: the fewest workers serve it
    assert winner["layout"]["label"] == "colocated x1" and winner["summary"]["unfinished"] == 0
    assert data["commands"] == [
        f"deltamesh serve --colocated --decode-workers 1 --model {DEFAULT_MODEL} --device cpu --max-num-seqs "
        f"{winner['layout']['colocated']['max_num_seqs']} --max-num-batched-tokens 256 --max-model-len 112"
    ]


def test_profile_refuses_a_bad_grid_in_one_line(tmp_path):
    for extra, message in (
        (["--decode-batches", "0"], "--decode-batches"),
        (["--mixed", "4:64:1"], "mixed point"),
        (["--device", "cuda:7"], "cuda"),
    ):
        result = CliRunner().invoke(app, ["profile", "--out", str(tmp_path / "x.json"), "--no-transfer", *extra])
        assert result.exit_code == 2 and message in result.output, result.output
        assert not (tmp_path / "x.json").exists()


def test_transfer_times_from_a_bench_transfer_json(tmp_path):
    rows = [
        {"mode": "ucx error handling on", "tokens": 1024, "seconds_median": 0.002, "phases_ms_median": {}},
        {"mode": "ucx error handling on", "tokens": 128, "seconds_median": 0.001, "phases_ms_median": {}},
        {
            "mode": "ucx error handling on",
            "tokens": 1024,
            "seconds_median": 0.009,
            "phases_ms_median": {},
            "in_flight": 2,
        },
        {"mode": "memcpy", "tokens": 1024, "seconds_median": 0.0001},
    ]
    path = tmp_path / "transfer.json"
    path.write_text(json.dumps({"results": rows}))
    moves = from_file(path)
    assert moves.points == [[128, 1.0], [1024, 2.0]] and moves.ms(576) == pytest.approx(1.5)
    path.write_text(json.dumps({"results": [rows[-1]]}))
    with pytest.raises(ValueError, match="no single back-to-back pull"):
        from_file(path)

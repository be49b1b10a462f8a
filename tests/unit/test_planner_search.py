"""The planner's choice (deltamesh/planner/search.py) where the numbers decide it, and `deltamesh plan` as a user
runs it: the table, the verdict, the command that deploys the winner, JSON, and clear refusals."""

import json
import math

import pytest
from test_planner_sim import synthetic
from typer.testing import CliRunner

from deltamesh.planner.layouts import Layout, Role
from deltamesh.planner.search import Planner
from deltamesh.planner.traffic import LengthDist, Sla, Traffic
from deltamesh.services.cli import app

# 8000-token prompts in one step of 400 ms (0.05 ms/token), 100 output tokens at 10 ms a step, 1 request/s
LONG_PROMPTS = Traffic(LengthDist.parse("8000"), LengthDist.parse("100"), request_rate=1.0, num_requests=300, seed=1)


def profile():
    return synthetic(per_token_ms=0.05, transfer=((1, 1.0), (10000, 2.0)))


def plan(sla: Sla):
    return Planner([profile()], LONG_PROMPTS, sla, max_gpus=8, seqs=(64,), budgets=(16384,)).run()


def test_colocated_wins_when_a_prompt_may_stall_the_decodes():
    # A TPOT p90 of 50 ms allows a 400 ms prompt inside a 100-token decode (about 14 ms per token); one colocated
    # GPU is busy 40 % of the time with prompts and serves 1 request/s: nothing on two GPUs can be as good per GPU.
    result = plan(Sla(ttft_p90_ms=2000, tpot_p90_ms=50))
    assert result.winner.layout.label == "colocated x1"
    assert result.best(True).meets and result.best(True).layout.gpus == 2


def test_prefill_decode_wins_when_no_prompt_may_stall_a_decode():
    # A TPOT p90 of 12 ms does not: a colocated request whose decode overlaps another's prompt gets 14 ms, so
    # colocated layouts meet it only with idle workers for most arrivals (least-loaded routing), here 4 GPUs;
    # 1P1D never mixes (10 ms a token, plus a 1.8 ms pull and at most one decode step's wait to join the batch,
    # over 99 tokens) and its prefill GPU is 40 % busy: 2 GPUs.
    result = plan(Sla(ttft_p90_ms=2000, tpot_p90_ms=12))
    winner, colocated = result.winner, result.best(False)
    assert winner.layout.label == "1P1D" and 10 < winner.summary["tpot_p90_ms"] <= 10 + (1.8 + 10) / 99
    assert colocated.meets and colocated.layout.gpus == 4
    two = next(e for e in result.evaluated if e.layout.label == "colocated x2")
    assert not two.meets and any("TPOT p90" in m for m in two.summary["misses"])


def test_a_layout_too_small_for_the_rate_misses_and_a_bigger_one_is_found():
    # 400 ms of prefill per request at 3 requests/s needs at least 2 prefill GPUs (120 % of one)
    busy = Traffic(LengthDist.parse("8000"), LengthDist.parse("100"), request_rate=3.0, num_requests=300, seed=2)
    result = Planner([profile()], busy, Sla(ttft_p90_ms=3000), max_gpus=6, seqs=(64,), budgets=(16384,)).run()
    one_prefill = [e for e in result.evaluated if e.layout.disaggregated and e.layout.prefill.workers == 1]
    assert one_prefill and all(any("TTFT" in m for m in e.summary["misses"]) for e in one_prefill)
    assert result.best(True).meets and result.best(True).layout.prefill.workers >= 2


def test_no_layout_within_the_budget_is_said_so():
    result = Planner([profile()], LONG_PROMPTS, Sla(ttft_p50_ms=100), max_gpus=2, seqs=(64,), budgets=(16384,)).run()
    assert result.winner is None
    from deltamesh.planner.report import render

    assert "no layout within 2 GPU(s) meets the SLA" in render(result)


def test_the_serving_path_adds_its_time_both_ways_to_every_layout_judged():
    # 1 request/s of 400 ms prompts: nothing queues, so each first token comes 2 x 30 ms later than without it
    sla = Sla(ttft_p90_ms=2000)
    plain = Planner([profile()], LONG_PROMPTS, sla, max_gpus=2, seqs=(64,), budgets=(16384,)).run()
    path = Planner([profile()], LONG_PROMPTS, sla, max_gpus=2, seqs=(64,), budgets=(16384,), path_ms=30.0).run()
    ttft = {e.layout.label: e.summary["ttft_p50_ms"] for e in plain.evaluated}
    assert ttft and all(e.summary["ttft_p50_ms"] == pytest.approx(ttft[e.layout.label] + 60) for e in path.evaluated)


def test_deploy_commands():
    p = profile()
    assert Layout(9000, colocated=Role(p, 3, 64, 4096)).commands() == [
        "deltamesh serve --colocated --decode-workers 3 --model models/m --load-format dummy --device cuda "
        "--dtype bfloat16 --max-num-seqs 64 --max-num-batched-tokens 4096 --max-model-len 9000 --gpus 0,1,2"
    ]
    assert (
        Layout(9000, prefill=Role(p, 2, 64, 4096), decode=Role(p, 1, 64, 4096))
        .commands()[0]
        .startswith("deltamesh serve --prefill-workers 2 --decode-workers 1 ")
    )
    # different parallelism per role: a router and one command per worker, each on its own GPUs
    tp2 = synthetic(gpus=2, name="tp2")
    lines = Layout(9000, prefill=Role(tp2, 1, 64, 4096), decode=Role(p, 2, 64, 4096)).commands()
    assert lines[1].startswith("deltamesh router ")
    assert lines[2].startswith("CUDA_VISIBLE_DEVICES=0,1 deltamesh prefill ") and "--tensor-parallel-size 2" in lines[2]
    assert lines[3].startswith("CUDA_VISIBLE_DEVICES=2 deltamesh decode ")
    assert lines[4].startswith("CUDA_VISIBLE_DEVICES=3 deltamesh decode ")


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "synthetic.json"
    profile().save(path)
    return path


def run(args):
    return CliRunner().invoke(app, ["plan", *args])


def test_plan_command_prints_the_table_the_verdict_and_the_command(profile_file, tmp_path):
    out = tmp_path / "plan.json"
    args = ["--profile", str(profile_file), "--input-len", "8000", "--output-len", "100", "--request-rate", "1"]
    args += ["--seed", "1", "--num-requests", "300", "--ttft-p90", "2000", "--tpot-p90", "12"]
    args += ["--max-num-seqs", "64", "--max-num-batched-tokens", "16384", "--json", str(out)]
    result = run(args)
    assert result.exit_code == 0, result.output
    assert "| layout" in result.output and "winner: 1P1D" in result.output
    assert "deltamesh serve --prefill-workers 1 --decode-workers 1" in result.output
    data = json.loads(out.read_text())
    assert data["winner"]["layout"]["label"] == "1P1D" and data["commands"]
    assert data["best_colocated"]["layout"]["gpus"] == 4
    assert all(math.isfinite(e["summary"]["ttft_p50_ms"]) for e in data["evaluated"] if e["summary"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--request-rate", "1", "--concurrency", "4"], "exactly one of a request rate and a concurrency"),
        (["--request-rate", "-1"], "request rate"),
        (["--request-rate", "1", "--ttft-p50", "0"], "SLA"),
        (["--request-rate", "1", "--max-num-seqs", "0,4"], "--max-num-seqs"),
        (["--request-rate", "1", "--input-len", "normal:5"], "length distribution"),
        (["--request-rate", "1", "--colocated-only", "--disaggregated-only"], "exclude each other"),
        (["--request-rate", "1", "--path-ms", "-1"], "serving path"),
    ],
)
def test_plan_command_refuses_bad_input_in_one_line(profile_file, extra, message):
    args = ["--profile", str(profile_file), "--input-len", "100", "--output-len", "10", *extra]
    result = run(args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_plan_command_names_a_bad_profile(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    result = run(["--profile", str(bad), "--input-len", "100", "--output-len", "10", "--request-rate", "1"])
    assert result.exit_code == 2 and "bad.json: not a deltamesh profile" in result.output


def test_a_profile_without_transfer_times_plans_colocated_only(tmp_path):
    p = profile()
    p.transfer.points = []
    path = tmp_path / "no-transfer.json"
    p.save(path)
    base = ["--profile", str(path), "--input-len", "100", "--output-len", "10", "--request-rate", "1"]
    refused = run(base)
    assert refused.exit_code == 2 and "no state-transfer times" in refused.output
    assert run([*base, "--colocated-only", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]).exit_code == 0

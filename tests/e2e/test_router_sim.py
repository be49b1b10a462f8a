"""bench/router_sim.py with the simulation spread over processes (--worker-processes, --client-processes): the real
router in front of two processes of simulated workers, streamed through by two load processes, every stream whole
and checked token by token. No timing assertions."""

import pytest
from harness import bench_rows

pytestmark = [pytest.mark.e2e, pytest.mark.scale]

MAX_TOKENS = 8


def test_tokens_over_two_worker_processes_and_two_client_processes(tmp_path):
    args = ["tokens", "--api", "grpc", "--concurrency", "4", "--duration", "2", "--max-tokens", str(MAX_TOKENS)]
    args += ["--prefill", "2", "--decode", "2", "--token-rate", "100", "--worker-processes", "2"]
    (row,) = bench_rows("router_sim.py", args + ["--client-processes", "2"], tmp_path / "tokens.json", timeout=180)
    assert (row["worker_processes"], row["client_processes"]) == (2, 2)
    assert row["errors"] == 0, row["first_errors"]
    assert row["wrong_streams"] == 0
    # both load processes streamed, and the row is their sum; every stream ran to its last token
    assert len(row["client_tokens"]) == 2 and min(row["client_tokens"]) > 0, row["client_tokens"]
    assert row["tokens"] == sum(row["client_tokens"])
    assert row["tokens"] == row["streams"] * MAX_TOKENS
    assert row["client_cores"] > 0 and row["sim_workers_cores"] > 0

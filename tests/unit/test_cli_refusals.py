"""Start-up mistakes a new user makes, refused before anything starts: one line on stderr naming the flag, exit
status 2 (a usage error), no traceback, no model loaded. Every case names a model directory that does not exist,
so that a check that fails to refuse ends at the model check (another message) instead of starting a mesh."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from deltamesh.services import cli
from deltamesh.services.common.options import SETTINGS_ENV

ROOT = Path(__file__).resolve().parents[2]
SECRET = {"DELTAMESH_MESH_SECRET": "s" * 32}
# serve's own ports left to be chosen later, where a test is about another port: the defaults (50051, 50052, 8000)
# lie in the ephemeral range, so under a busy test run another test's connection may hold one for a moment
ROUTER_PORTS_LATER = ["--grpc-port", "0", "--control-port", "0", "--http-port", "0"]
PROCESS_TIMEOUT_S = 300  # a CLI process start: seconds idle, a minute on 2 busy cores; only paid when it hangs


@pytest.fixture
def missing_model(tmp_path) -> list[str]:
    return ["--model", str(tmp_path / "no-such-model")]


def serve_values(argv: list[str]) -> dict:
    """`deltamesh serve ARGV`'s option values, as the command gets them."""
    command = typer.main.get_command(cli.app).commands["serve"]
    return dict(command.make_context("serve", argv).params)


def refusal(argv: list[str]) -> str:
    """The one line `deltamesh ARGV` refuses with (exit status 2)."""
    result = CliRunner().invoke(cli.app, argv, env=SECRET)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, (argv, result.exit_code, result.stderr, result.exception)
    assert lines[0].startswith(f"deltamesh {argv[0]}: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["serve", "--grpc-port", "99999"], "--grpc-port 99999: input should be less than or equal to 65535"),
        (["serve", "--http-port", "-1"], "--http-port -1: input should be greater than or equal to 0"),
        (["router", "--grpc-port", "70000"], "--grpc-port 70000: input should be less than or equal to 65535"),
        (["router", "--control-port", "-1"], "--control-port -1: input should be greater than or equal to 0"),
        (["prefill", "--port", "65536"], "--port 65536: input should be less than or equal to 65535"),
        (["decode", "--metrics-port", "70000"], "--metrics-port 70000: input should be less than or equal to 65535"),
        (["router", "--max-prompts", "0"], "--max-prompts 0: input should be greater than or equal to 1"),
        (["serve", "--decode-workers", "0"], "--decode-workers 0: input should be greater than or equal to 1"),
        (["serve", "--worker-port-base", "0"], "--worker-port-base 0: input should be greater than or equal to 1"),
    ],
)
def test_a_value_out_of_range_is_refused_in_one_line_naming_its_flag(argv, says, missing_model):
    assert refusal(argv + missing_model).endswith(says)


def test_any_two_ports_serve_binds_must_differ(missing_model):
    line = refusal(["serve", "--grpc-port", "21001", "--control-port", "21001"] + missing_model)
    assert line.endswith("--grpc-port and --control-port are both port 21001: every port must differ")
    line = refusal(["serve", "--control-port", "21002", "--http-port", "21002"] + missing_model)
    assert "--control-port and --http-port are both port 21002" in line
    line = refusal(["router", "--grpc-port", "21003", "--http-port", "21003"] + missing_model)
    assert "--grpc-port and --http-port are both port 21003" in line
    # the workers' fixed ports count too: decode-0 is the second worker, on BASE+2 and BASE+3
    line = refusal(["serve", "--worker-port-base", "21010", "--http-port", "21013"] + missing_model)
    assert "--http-port and decode-0's metrics port from --worker-port-base are both port 21013" in line
    line = refusal(["prefill", "--port", "21004", "--metrics-port", "21004"] + missing_model)
    assert "--port and --metrics-port are both port 21004" in line


def test_worker_ports_past_the_last_port_are_refused(missing_model):
    line = refusal(["serve", "--worker-port-base", "65533", "--prefill-workers", "2"] + missing_model)
    assert line.endswith("--worker-port-base 65533: 3 workers need ports up to 65538; ports end at 65535")


def test_a_taken_worker_port_is_named_with_the_worker(missing_model):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = refusal(["serve", "--worker-port-base", str(port), *ROUTER_PORTS_LATER] + missing_model)
    assert f"cannot listen on 127.0.0.1:{port} (prefill-0's gRPC port from --worker-port-base)" in line
    assert "in use" in line


def test_serve_without_prefill_workers_needs_colocated(missing_model):
    line = refusal(["serve", "--prefill-workers", "0", *ROUTER_PORTS_LATER] + missing_model)
    assert "--prefill-workers 0 leaves the decode workers nothing to decode" in line and "--colocated" in line
    # with --colocated it is a mesh of colocated workers: past the checks, on to the model (which is missing)
    argv = ["serve", "--prefill-workers", "0", "--colocated", *ROUTER_PORTS_LATER] + missing_model
    result = CliRunner().invoke(cli.app, argv, env=SECRET)
    assert result.exit_code == 2 and "no config.json" in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["serve", "router", "prefill"])
def test_a_bad_host_is_reported_as_a_host_problem(command, missing_model):
    assert refusal([command, "--host", "999.1.1.1"] + missing_model).endswith(
        "cannot listen on --host 999.1.1.1: Name or service not known"
    )
    # an address of another machine: resolvable, not this host's
    assert refusal([command, "--host", "192.0.2.1"] + missing_model).endswith(
        "cannot listen on --host 192.0.2.1: Cannot assign requested address"
    )


def test_worker_port_base_gives_each_worker_its_ports_in_start_order():
    values = serve_values(["--worker-port-base", "20000", "--prefill-workers", "2", "--decode-workers", "2"])
    specs, urls = cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))
    handed = {s.name: json.loads(s.env[SETTINGS_ENV]) for s in specs[1:]}
    assert {name: (h["port"], h["metrics_port"]) for name, h in handed.items()} == {
        "prefill-0": (20000, 20001),
        "prefill-1": (20002, 20003),
        "decode-0": (20004, 20005),
        "decode-1": (20006, 20007),
    }
    assert urls[0] == "prefill http://127.0.0.1:20001/metrics"
    # without it, free ports below the ephemeral range, none of them the router's
    values = serve_values(["--grpc-port", "20100", "--control-port", "20101", "--http-port", "20102"])
    specs, _ = cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))
    handed = [json.loads(s.env[SETTINGS_ENV]) for s in specs[1:]]
    ports = [h[key] for h in handed for key in ("port", "metrics_port")]
    assert len(set(ports)) == 4 and not set(ports) & {20100, 20101, 20102}


def test_the_real_command_refuses_in_one_line_without_a_traceback(missing_model):
    """The issue's own example, as a process: no 50-line traceback, exit status 2, before any model loads."""
    done = subprocess.run(
        [sys.executable, "-m", "deltamesh.services.cli", "serve", "--grpc-port", "99999", *missing_model],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "deltamesh serve: --grpc-port 99999: input should be less than or equal to 65535"
    ], done.stderr
    assert not done.stdout

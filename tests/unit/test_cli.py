"""The `deltamesh` command as a new user meets it: one flag name for the router's address, `serve` taking the
worker flags it passes on, and a taken port named at once instead of after the model loads."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import typer

from deltamesh.services.cli import app

ROOT = Path(__file__).resolve().parents[2]


def params(argv: list[str]) -> dict:
    command = typer.main.get_command(app).commands[argv[0]]
    return dict(command.make_context(argv[0], argv[1:]).params)


def test_generate_takes_the_router_flag_the_workers_take():
    assert params(["generate", "--router", "10.0.0.1:50051", "hi"])["address"] == "10.0.0.1:50051"
    assert params(["generate", "--address", "10.0.0.1:50051", "hi"])["address"] == "10.0.0.1:50051"


def test_serve_takes_the_worker_flags_it_passes_on():
    got = params(["serve", "--lease-ttl", "10", "--max-lease-ttl", "60", "--transfer-timeout", "5",
                  "--admission-timeout", "2"])  # fmt: skip
    assert (got["lease_ttl"], got["max_lease_ttl"], got["transfer_timeout"], got["admission_timeout"]) == (10, 60, 5, 2)


def test_a_taken_port_is_named_at_once():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        router = ["router", "--grpc-port", "0", "--control-port", "0", "--http-port", str(port)]
        for argv, flag in ((["prefill", "--port", str(port)], "--port"), (router, "--http-port")):
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "deltamesh.services.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                                  timeout=60, env={"DELTAMESH_MESH_SECRET": "s" * 32, "PATH": "/usr/bin:/bin"})  # fmt: skip
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert f"127.0.0.1:{port} ({flag})" in lines[0] and "in use" in lines[0]
            assert time.monotonic() - started < 10  # the process's start-up; the model never loads


def test_help_at_80_columns_names_every_option_in_full():
    done = subprocess.run([sys.executable, "-m", "deltamesh.services.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0 and "…" not in done.stdout
    for option in ("--max-num-batched-tokens", "--ucx-error-handling", "--mesh-secret-file", "--admission-timeout"):
        assert option in done.stdout, option

"""The `deltamesh` command as a new user meets it: one flag name for the router's address, `serve` taking the
worker flags it passes on, and a taken port named at once instead of after the model loads; and the settings
behind the flags: every engine setting a flag, each flag filling its setting, `serve` handing its children their
settings."""

import json
import os
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import typer

from deltamesh.engine.engine_config import EngineConfig
from deltamesh.services import cli
from deltamesh.services.cli import app
from deltamesh.services.common.options import SETTINGS_ENV, SETTINGS_PARENT_ENV, handed_settings, settings_from
from deltamesh.services.common.settings import RouterSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
# A CLI process start (Python, torch): seconds on an idle machine, over a minute on a 2-core machine shared with
# other work. Only paid when a process hangs.
PROCESS_TIMEOUT_S = 300


def params(argv: list[str]) -> dict:
    command = typer.main.get_command(app).commands[argv[0]]
    return dict(command.make_context(argv[0], argv[1:]).params)


def test_generate_takes_the_router_flag_the_workers_take():
    assert params(["generate", "--router", "10.0.0.1:50051", "hi"])["address"] == "10.0.0.1:50051"
    assert params(["generate", "--address", "10.0.0.1:50051", "hi"])["address"] == "10.0.0.1:50051"


def test_serve_takes_the_worker_flags_it_passes_on():
    got = params(
        ["serve", "--lease-ttl", "10", "--max-lease-ttl", "60", "--transfer-timeout", "5", "--admission-timeout", "2"]
    )
    assert (got["lease_ttl"], got["max_lease_ttl"], got["transfer_timeout"], got["admission_timeout"]) == (10, 60, 5, 2)


def test_a_taken_port_is_named_at_once():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        router = ["router", "--grpc-port", "0", "--control-port", "0", "--http-port", str(port)]
        for argv, flag in ((["prefill", "--port", str(port)], "--port"), (router, "--http-port")):
            done = subprocess.run(
                [sys.executable, "-m", "deltamesh.services.cli", *argv],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=PROCESS_TIMEOUT_S,
                env={"DELTAMESH_MESH_SECRET": "s" * 32, "PATH": "/usr/bin:/bin"},
            )
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert f"127.0.0.1:{port} ({flag})" in lines[0] and "in use" in lines[0]
            assert "model loaded" not in done.stdout + done.stderr  # at once: before the model loads


def test_settings_handed_to_another_process_are_ignored_with_a_warning():
    """A copy of serve's hand-over left in a shell: a worker started by hand keeps its own flags."""
    handed = json.dumps({"transport": "ucx"})
    done = subprocess.run(
        [sys.executable, "-m", "deltamesh.services.cli", "prefill", "--transport", "nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        env={
            "DELTAMESH_MESH_SECRET": "s" * 32,
            "PATH": "/usr/bin:/bin",
            SETTINGS_ENV: handed,
            SETTINGS_PARENT_ENV: "1",
        },
    )
    assert done.returncode == 2 and "unknown transport 'nosuch'" in done.stderr  # its own flag, refused
    assert f"ignoring {SETTINGS_ENV}" in done.stderr


def test_serve_gives_each_tensor_parallel_worker_its_own_gpus():
    values = params(
        [
            "serve",
            "--device",
            "cuda",
            "--colocated",
            "--decode-workers",
            "2",
            "--tensor-parallel-size",
            "2",
            "--gpus",
            "0,1,2,3",
        ]
    )
    specs, _ = cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs[1:]] == ["0,1", "2,3"]
    values = params(["serve", "--device", "cuda", "--colocated", "--data-parallel-size", "2", "--gpus", "0,1,2,3"])
    specs, _ = cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs[1:]] == ["0,1"]
    values = params(["serve", "--device", "cuda", "--colocated", "--tensor-parallel-size", "2", "--gpus", "0"])
    with pytest.raises(typer.BadParameter, match="of 2 ranks .* needs 2 GPUs"):
        cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))


def test_help_at_80_columns_names_every_option_in_full():
    done = subprocess.run(
        [sys.executable, "-m", "deltamesh.services.cli", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and "…" not in done.stdout
    for option in ("--max-num-batched-tokens", "--ucx-error-handling", "--mesh-secret-file", "--admission-timeout"):
        assert option in done.stdout, option


def test_every_engine_setting_is_a_flag_of_the_commands_that_run_an_engine():
    engine_flags = {f.metadata.get("flag", f.name) for f in fields(EngineConfig) if f.metadata.get("cli", True)}
    for command in ("prefill", "decode", "colocated", "serve"):
        names = set(params([command]))
        missing = (
            engine_flags - names - ({"torch_threads"} if command == "serve" else set())
        )  # serve shares threads out
        assert not missing, (command, missing)


def test_a_flag_fills_its_setting():
    worker = settings_from(
        WorkerSettings,
        cli.WORKER,
        params(
            [
                "prefill",
                "--page-size",
                "32",
                "--kernels",
                "torch",
                "--lease-ttl",
                "7",
                "--tls-client-auth",
                "--prefix-cache-memory",
                "2.5",
            ]
        ),
        role="prefill",
        mesh_secret="s" * 32,
    )
    assert (worker.engine.page_size, worker.engine.kernel_backend, worker.lease_ttl_s) == (32, "torch", 7.0)
    assert worker.engine.prefix_cache_memory_gb == 2.5  # GiB, a float
    assert worker.tls.client_auth and worker.engine.max_num_seqs == EngineConfig().max_num_seqs
    router = settings_from(
        RouterSettings,
        cli.ROUTER,
        params(["router", "--max-prompts", "3", "--http-port", "0", "--prefill", "a:1", "--prefill", "b:2"]),
        mesh_secret="s" * 32,
    )
    assert (router.limits.max_prompts, router.http_port, router.prefill, router.decode) == (3, None, ["a:1", "b:2"], [])


def test_serve_hands_each_child_its_settings_in_the_environment_and_never_a_secret(monkeypatch):
    monkeypatch.setenv("DELTAMESH_POLICY", "round_robin")  # a router setting from serve's environment
    values = params(
        [
            "serve",
            "--page-size",
            "32",
            "--no-cuda-graphs",
            "--transfer-timeout",
            "5",
            "--grpc-port",
            "6000",
            "--http-port",
            "0",
            "--api-key",
            "k" * 20,
            "--max-model-len",
            "512",
            "--served-model-name",
            "tiny",
        ]
    )
    specs, _ = cli._children(values, "s" * 32, *cli._plan(values, "s" * 32))
    assert [s.argv[3:] for s in specs] == [["router"], ["prefill"], ["decode"]]
    for spec in specs:
        handed = spec.env[SETTINGS_ENV]
        assert "s" * 32 not in handed and "k" * 20 not in handed and spec.env["DELTAMESH_MESH_SECRET"] == "s" * 32
    router_spec, prefill_spec, _ = specs
    assert router_spec.env[SETTINGS_PARENT_ENV] == str(os.getpid())  # handed by this process, to its children
    for spec in (router_spec, prefill_spec):  # read here as a child of this process reads them
        spec.env[SETTINGS_PARENT_ENV] = str(os.getppid())
    monkeypatch.setattr(os, "environ", router_spec.env)  # the child's environment
    router = settings_from(RouterSettings, cli.ROUTER, params(["router"]), handed_settings(), mesh_secret="s" * 32)
    assert (router.grpc_port, router.http_port, router.max_model_len, router.policy) == (6000, None, 512, "round_robin")
    assert router.api_key == "k" * 20 and router.served_model_name == ["tiny"]
    monkeypatch.setattr(os, "environ", prefill_spec.env)
    worker = settings_from(
        WorkerSettings, cli.WORKER, params(["prefill"]), handed_settings(), role="prefill", mesh_secret="s" * 32
    )
    assert (worker.engine.page_size, worker.engine.cuda_graphs, worker.transfer_timeout_s) == (32, False, 5.0)
    assert worker.router == "127.0.0.1:50052" and worker.port and worker.metrics_port and worker.engine.torch_threads
    assert worker.served_model_name == ["tiny"]  # what its vLLM-named metrics label the model by


def test_a_model_or_device_this_machine_cannot_serve_is_named_at_once(tmp_path):
    """A wrong --model (or --device cuda on a machine without a GPU): one line, before anything starts and before
    any model loads; a worker or router exits with the configuration-error status, so that `serve` would not
    restart it, and `serve` itself refuses with a usage error."""
    import torch

    from deltamesh.services.supervisor import CONFIG_ERROR

    missing = str(tmp_path / "no-such-model")
    cases = [
        (["prefill", "--model", missing, "--port", "0", "--metrics-port", "0"], CONFIG_ERROR, "no config.json"),
        (
            ["router", "--model", missing, "--grpc-port", "0", "--control-port", "0", "--http-port", "0"],
            CONFIG_ERROR,
            "no config.json",
        ),
        (
            ["serve", "--model", missing, "--grpc-port", "0", "--control-port", "0", "--http-port", "0"],
            2,
            "no config.json",
        ),
    ]
    if not torch.cuda.is_available():
        cases.append(
            (
                ["serve", "--device", "cuda", "--grpc-port", "0", "--control-port", "0", "--http-port", "0"],
                2,
                "finds no CUDA GPU",
            )
        )
    for argv, code, why in cases:
        done = subprocess.run(
            [sys.executable, "-m", "deltamesh.services.cli", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=PROCESS_TIMEOUT_S,
            env={"DELTAMESH_MESH_SECRET": "s" * 32, "PATH": "/usr/bin:/bin"},
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == code and len(lines) == 1 and why in lines[0], (argv, done.stderr)
        assert "model loaded" not in done.stdout + done.stderr, argv  # at once: no model loads


def test_the_sdk_script_without_its_cli_extra_says_how_to_install_it():
    """`pip install deltamesh-client` alone installs the library and the `deltamesh-client` script but not typer:
    the script says which extra it needs instead of a traceback (typer hidden from the import system here)."""
    hide = "import sys; sys.modules['typer'] = None; from deltamesh.client.command import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hide, "hi"], cwd=ROOT, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S
    )
    assert done.returncode == 1 and done.stderr.strip() == (
        "deltamesh-client: the command line needs the package's cli extra: pip install 'deltamesh-client[cli]'"
    )
    done = subprocess.run(
        [sys.executable, "-c", "from deltamesh.client.command import main; main()", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0 and "--max-tokens" in done.stdout, done.stderr

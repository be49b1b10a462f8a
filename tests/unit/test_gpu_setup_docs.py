"""The README's GPU section, checked here without a GPU: its commands are Makefile targets, and what they run
(`make -n`) is what the section says: torch at the pinned version from PyTorch's CUDA index (cu130, or cu128 when
asked), the `gpu` extra with FlashInfer and fla, and a `deltamesh serve` whose flags serve itself parses to CUDA,
bfloat16 and a share of the GPU for each worker. tests/gpu/test_gpu_setup.py runs that command on a GPU."""

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import typer

from deltamesh.services import cli

ROOT = Path(__file__).resolve().parents[2]


def gpu_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## GPU\n", 1)[1].split("\n## ", 1)[0]


def dry_run(*args: str) -> list[str]:
    """The command lines `make -n ARGS` would run (no .venv needed: nothing runs)."""
    out = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if not line.startswith("echo ")]


def serve_values(argv: list[str]) -> dict:
    command = typer.main.get_command(cli.app).commands["serve"]
    return dict(command.make_context("serve", argv).params)


def test_the_sections_commands_are_make_targets():
    [block] = re.findall(r"```bash\n(.*?)```", gpu_section(), re.S)
    commands = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert commands == [["make", "setup-gpu"], ["make", "run-gpu"]]
    makefile = (ROOT / "Makefile").read_text()
    for _, target in commands:
        assert re.search(rf"^{target}:", makefile, re.M) and target in makefile.split(".PHONY:")[1].split("\n")[0]


def test_setup_gpu_installs_the_pinned_torch_built_for_cuda_and_the_gpu_extra():
    pin = re.search(r"^TORCH_PIN := (torch==\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    lines = dry_run("setup-gpu")
    assert f"pip install -q {pin} --index-url https://download.pytorch.org/whl/cu130" in "\n".join(lines)
    assert any('-e ".[dev,gpu]"' in line for line in lines)
    assert any("torch.cuda.is_available()" in line for line in lines)  # it ends by checking the GPU is seen
    cu128 = dry_run("setup-gpu", "TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128")
    assert f"pip install -q {pin} --index-url https://download.pytorch.org/whl/cu128" in "\n".join(cu128)
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert {re.split(r"[<>=]", d)[0] for d in gpu_extra} >= {"flashinfer-python", "fla-core"}


def test_run_gpu_is_a_serve_command_on_cuda_in_bfloat16_with_a_share_per_worker():
    [line] = dry_run("run-gpu")
    argv = shlex.split(line)
    assert argv[0] == ".venv/bin/deltamesh" and argv[1] == "serve"
    values = serve_values(argv[2:])
    assert values["device"] == "cuda" and values["dtype"] == "bfloat16"
    assert values["gpu_memory_utilization"] == 0.4  # two workers on GPU 0 fit: 0.8 of it
    [line] = dry_run("run-gpu", "ARGS=--model /models/x --load-format dummy", "GPU_SHARE=0.45")
    values = serve_values(shlex.split(line)[2:])
    assert values["model"] == "/models/x" and values["load_format"] == "dummy"
    assert values["gpu_memory_utilization"] == 0.45
    assert "--gpu-memory-utilization 0.4" in gpu_section() and "GPU_SHARE=0.45" in gpu_section()

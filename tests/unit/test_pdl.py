"""Programmatic dependent launch's switch (kernels/pdl.py): launch keywords only for a GPU that has it, and a clear
error for a setting it does not know. (Its kernels compile with it: test_triton_compile.py; run: tests/gpu.)"""

import os
import subprocess
import sys

import torch

from deltamesh.kernels import pdl


def test_no_launch_keywords_off_the_gpu_whatever_the_mode(monkeypatch):
    for mode in range(4):
        monkeypatch.setattr(pdl, "MODE", mode)
        assert pdl.kwargs(torch.device("cpu")) == {}


def test_an_unknown_setting_is_refused_when_the_kernels_are_imported():
    env = dict(os.environ, DELTAMESH_PDL="on")
    run = subprocess.run(
        [sys.executable, "-c", "import deltamesh.kernels.pdl"], env=env, capture_output=True, text=True, check=False
    )
    assert run.returncode != 0 and "DELTAMESH_PDL must be 0, 1, 2 or 3" in run.stderr

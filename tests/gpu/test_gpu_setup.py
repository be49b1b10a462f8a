"""The README's GPU section followed on a GPU host (after `make setup-gpu`): the command `make run-gpu` runs (read
with `make -n`, at LOG_LEVEL=info, on free ports through serve's environment variables) starts a mesh on CUDA in
bfloat16 that answers over REST and the SDK, and stops on Ctrl-C. tests/unit/test_gpu_setup_docs.py checks the
same section without a GPU."""

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from deltamesh.client import Client
from deltamesh.engine import DEFAULT_MODEL
from deltamesh.services.common.ports import free_port

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600  # two workers loading and warming up (CUDA graphs) on one GPU


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_make_run_gpu_serves_on_cuda_in_bfloat16(tmp_path):
    # LOG_LEVEL=info: the engines' "engine ready" lines say where they run
    make = ["make", "-n", "--no-print-directory", "run-gpu", "LOG_LEVEL=info"]
    dry = subprocess.run(make, cwd=ROOT, capture_output=True, text=True)
    [line] = [x for x in dry.stdout.splitlines() if x.strip()]
    if not (ROOT / shlex.split(line)[0]).exists():  # the GPU host's own torch, no `make setup-gpu` (needs an index)
        pytest.skip(f"{shlex.split(line)[0]} is missing: run make setup-gpu first")
    grpc_port, http_port = free_port(), free_port()
    env = {
        **os.environ,
        "DELTAMESH_GRPC_PORT": str(grpc_port),
        "DELTAMESH_CONTROL_PORT": str(free_port()),
        "DELTAMESH_HTTP_PORT": str(http_port),
    }
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(shlex.split(line), cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "mesh ready" not in log.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        engines = [json.loads(x) for x in log.read_text().splitlines() if '"engine ready"' in x]
        assert len(engines) == 2 and all("cuda" in e["device"] and "bfloat16" in e["dtype"] for e in engines)
        body = {"model": DEFAULT_MODEL.name, "prompt": "The Python language", "max_tokens": 16, "temperature": 0}
        rest = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=120).json()
        assert rest["usage"]["completion_tokens"] > 0, rest
        with Client(f"127.0.0.1:{grpc_port}") as client:
            result = client.generate("The Python language", max_tokens=16, temperature=0)
        assert result.text == rest["choices"][0]["text"]
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
        assert re.search(r"mesh ready \(1 prefill \+ 1 decode\)", log.read_text())
    finally:
        if serve.poll() is None:
            serve.kill()

"""Workers sharing one GPU, each within its --gpu-memory-utilization (engine/memory_budget.py): `deltamesh serve`
with 1P+1D on GPU 0 gives the monolithic engine's greedy tokens (fp32) and every worker stays within its share of
the GPU (nvidia-smi's per-process use, where it shows this host's processes); a share bounds the KV pool, and a
worker's largest step (a whole --max-num-batched-tokens of prompt) fits in it beside the pool."""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.services.common.ports import free_port

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
NINE_B = ROOT / "bench" / "configs" / "qwen3.5-9b"
PROMPTS = [[(11 * i + 5) % 3000 + 10 for i in range(n)] for n in (7, 40, 129, 300, 511)]
PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def gpu_use_by_pid() -> dict[int, int] | None:
    """Bytes of GPU memory each process uses (nvidia-smi), or None where it cannot tell (no nvidia-smi, or its
    processes are another PID namespace's)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
    try:
        return {int(pid): int(mib) * 2**20 for pid, mib in rows}
    except ValueError:
        return None


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_serve_1p_1d_on_one_gpu_with_fractions_matches_the_monolithic_engine(tmp_path):
    from deltamesh.client import AsyncClient
    from deltamesh.services.router.control import read_loads

    total = torch.cuda.get_device_properties(0).total_memory
    shares = {"prefill": 0.2, "decode": 0.3}
    grpc_port, control_port = free_port(), free_port()
    secret = "s" * 32
    log = tmp_path / "serve.log"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltamesh.services.cli",
            "serve",
            "--device",
            "cuda",
            "--dtype",
            "float32",
            "--gpus",
            "0",
            "--max-model-len",
            "1024",
            "--prefill-gpu-memory-utilization",
            str(shares["prefill"]),
            "--decode-gpu-memory-utilization",
            str(shares["decode"]),
            "--grpc-port",
            str(grpc_port),
            "--control-port",
            str(control_port),
            "--http-port",
            "0",
            "--no-ucx-error-handling",
        ],
        cwd=ROOT,
        env={**os.environ, "DELTAMESH_MESH_SECRET": secret},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while "mesh ready" not in log.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)

        async def through_mesh():
            async with AsyncClient(f"127.0.0.1:{grpc_port}") as client:
                return await asyncio.gather(
                    *(client.generate(p, max_tokens=32, temperature=0, ignore_eos=True) for p in PROMPTS)
                )

        got = [r.token_ids for r in asyncio.run(through_mesh())]
        loads = {w.role: w for w in read_loads(f"127.0.0.1:{control_port}", secret)}
        used = gpu_use_by_pid()
        if used is not None:
            assert serve.pid not in used  # serve checked the budgets without taking any GPU memory
            workers = [pid for pid in children(serve.pid) if pid in used]
            assert len(workers) == 2, (used, children(serve.pid))
            for pid in workers:
                role = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3].decode()
                assert used[pid] <= shares[role] * total, (role, used[pid] / 2**30, shares[role] * total / 2**30)
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(60)
    assert loads["prefill"].healthy and loads["decode"].healthy
    config = EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="float32", max_model_len=1024)
    with Engine(config) as mono:
        assert got == [r.token_ids for r in mono.generate(PROMPTS, PARAMS)]


def test_a_share_bounds_the_kv_pool_and_holds_the_largest_step():
    total = torch.cuda.get_device_properties(0).total_memory
    # 36 GiB hold the 9B shape's weights and pools, a 16k-token step's reserve and one request at 65536 tokens with
    # room for a pool (memory_budget's error itemises them): the share is that much of whichever GPU, at least 0.3
    share = max(0.3, round(36 * 2**30 / total, 2))
    config = EngineConfig(
        model=str(NINE_B),
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=65536,
        max_num_seqs=16,
        max_num_batched_tokens=16384,
        gpu_memory_utilization=share,
    )
    with Engine(config) as engine:
        pool = engine.loads()["kv_pages_total"]
        assert 0 < pool < 16 * 65536 // 16  # the share, not the requests at their longest, bounds it
        prompt = [(7 * i) % 30000 + 10 for i in range(16384 + 100)]  # a full step of prompt, then a chunk more
        engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert torch.cuda.max_memory_reserved() <= share * total
        used = gpu_use_by_pid()
        if used is not None and os.getpid() in used:
            assert used[os.getpid()] <= share * total, (used[os.getpid()] / 2**30, share * total / 2**30)

"""Worker memory budgets (deltamesh/engine/memory_budget.py): the arithmetic that sizes a KV pool from
--gpu-memory-utilization / --kv-cache-memory-gb, with budgets in bytes (no GPU here), its one-line errors, the
sizes it computes against the pools and models the engine builds, and serve's check of workers sharing a GPU."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig
from deltamesh.engine import memory_budget as mb
from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.weights import build_model
from deltamesh.services.gpu_shares import PlannedWorker, check_sharing

ROOT = Path(__file__).resolve().parents[2]
NINE_B = str(ROOT / "bench" / "configs" / "qwen3.5-9b")
GIB = 2**30
H200 = 140 * GIB  # the total memory a one-H200 host shows (about)


def nine_b(**overrides) -> EngineConfig:
    """The one-H200 sweep's decode worker: 9B shape, bf16, 64 requests of 8192 + 1024 tokens."""
    settings = dict(
        model=NINE_B,
        device="cuda",
        dtype="bfloat16",
        max_model_len=9232,
        max_num_seqs=64,
        max_num_batched_tokens=16384,
    )
    return EngineConfig(**{**settings, **overrides})


def footprint(c: EngineConfig) -> mb.Footprint:
    mc = ModelConfig.from_dir(Path(c.model))
    return mb.estimate(c, mc, c.resolved_max_model_len(mc.max_position_embeddings))


def test_the_sizes_are_those_of_the_pools_and_the_model_the_engine_builds():
    mc = ModelConfig.from_dir(DEFAULT_MODEL)
    c = EngineConfig(page_size=16)
    slots = StatePool(
        3,
        len(mc.linear_layers),
        mc.conv_dim,
        mc.linear_conv_kernel_dim,
        mc.linear_num_value_heads,
        mc.linear_key_head_dim,
        mc.linear_value_head_dim,
        torch.float32,
        torch.bfloat16,
        torch.device("cpu"),
    )
    assert mb.state_bytes(mc, torch.float32, torch.bfloat16) == slots.slot_bytes
    kv = KVPagePool(4, 16, len(mc.full_layers), mc.num_key_value_heads, mc.head_dim, torch.float32, torch.device("cpu"))
    assert mb.page_bytes(c, mc, torch.float32) == kv.page_bytes
    fp = footprint(c)
    model = build_model(mc, torch.device("cpu"), torch.float32)
    assert fp.weights == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    checkpoints = 2 * c.max_num_seqs  # the prefix cache's default: each pool has its scratch slot too
    slot = mb.state_bytes(mc, torch.float32, torch.float32)  # the engine's default dtypes on CPU
    assert fp.states == (c.max_num_seqs + 1 + checkpoints + 1) * slot


def test_a_share_of_the_gpu_holds_weights_pools_runtime_and_the_rest_is_kv_cache():
    c = nine_b(gpu_memory_utilization=0.45, max_num_seqs=256)  # more requests than the share holds at full length
    fp = footprint(c)
    assert 16 * GIB < fp.weights < 17.5 * GIB  # the 9B shape's bf16 weights (18 GB)
    assert 2 * GIB < fp.runtime < 12 * GIB  # a 16k-token step's activations, graphs, context: estimated
    pages = mb.size_kv_pool(c, 9232, fp, H200)
    left = int(0.45 * H200) - fp.weights - fp.states - fp.runtime
    assert pages == left // fp.page_bytes and pages < mb.most_pages(c, 9232)
    # measured use (weights and pools as allocated) stands in for the estimate once the worker has loaded
    assert mb.size_kv_pool(c, 9232, fp, H200, allocated=fp.weights + fp.states + GIB) == (left - GIB) // fp.page_bytes
    # a share with room to spare: the pool stops at every request at its longest, as without a budget
    roomy = nine_b(gpu_memory_utilization=0.45)
    assert mb.size_kv_pool(roomy, 9232, footprint(roomy), H200) == 64 * math.ceil(9232 / 16)


def test_a_share_too_small_for_one_request_says_what_it_holds_and_the_least_that_does():
    c = nine_b(gpu_memory_utilization=0.2)
    fp = footprint(c)
    with pytest.raises(mb.MemoryBudgetError) as e:
        mb.size_kv_pool(c, 9232, fp, H200)
    message = str(e.value)
    assert "\n" not in message and message.startswith("--gpu-memory-utilization 0.2 gives this worker 28.00 GiB")
    assert "weights 16." in message and "one request at --max-model-len 9232" in message
    least = float(message.split("give at least ")[1].split(",")[0])
    assert 0.2 < least < 0.3
    assert mb.size_kv_pool(replace(c, gpu_memory_utilization=least), 9232, fp, H200) >= fp.request_pages
    with pytest.raises(mb.MemoryBudgetError):
        mb.size_kv_pool(replace(c, gpu_memory_utilization=least - 0.01), 9232, fp, H200)


def test_a_kv_size_given_must_hold_a_request_and_fit_the_share():
    fp = footprint(nine_b())
    with pytest.raises(mb.MemoryBudgetError, match=r"--kv-cache-memory-gb 0.1 holds 204 KV pages .* needs 577"):
        mb.size_kv_pool(nine_b(kv_cache_memory_gb=0.1), 9232, fp, H200)
    assert mb.size_kv_pool(nine_b(kv_cache_memory_gb=8), 9232, fp, H200) == 8 * GIB // fp.page_bytes
    with pytest.raises(mb.MemoryBudgetError, match=r"short of .* KV pool 16.00 GiB \(32768 pages\)"):
        mb.size_kv_pool(nine_b(kv_cache_memory_gb=16, gpu_memory_utilization=0.3), 9232, fp, H200)
    # CPU: a budget in bytes, or the default GiB
    tiny = EngineConfig(max_model_len=4096)
    tiny_fp = footprint(tiny)
    assert mb.size_kv_pool(tiny, 4096, tiny_fp) == min(mb.most_pages(tiny, 4096), GIB // tiny_fp.page_bytes)
    with pytest.raises(mb.MemoryBudgetError, match="--kv-cache-memory-gb 0.001 holds 32 KV pages"):
        mb.size_kv_pool(replace(tiny, kv_cache_memory_gb=0.001), 4096, tiny_fp)


def test_without_a_budget_the_gpu_pool_takes_85_percent_of_the_free_memory():
    c = nine_b(max_num_seqs=512)
    fp = footprint(c)
    assert mb.size_kv_pool(c, 9232, fp, H200, gpu_free=40 * GIB) == int(0.85 * 40 * GIB) // fp.page_bytes
    with pytest.raises(mb.MemoryBudgetError, match="85% of the free GPU memory"):
        mb.size_kv_pool(c, 9232, fp, H200, gpu_free=GIB // 10)


def test_an_engine_sizes_its_pool_from_its_budget_and_refuses_one_that_holds_no_request():
    with Engine(EngineConfig(kv_cache_memory_gb=0.01, max_model_len=512, prefix_cache=False)) as engine:
        page = engine.core.kv_pool.page_bytes
        assert engine.loads()["kv_pages_total"] == min(32 * 512 // 16, int(0.01 * GIB) // page)
    with pytest.raises(mb.MemoryBudgetError, match="--kv-cache-memory-gb 1e-05 holds 0 KV pages"):
        Engine(EngineConfig(kv_cache_memory_gb=1e-5, max_model_len=512, prefix_cache=False))


def test_a_fraction_is_for_the_gpu_and_between_0_and_1():
    with pytest.raises(ValueError, match=r"on the CPU, bound the KV cache with kv_cache_memory_gb"):
        EngineConfig(gpu_memory_utilization=0.5).validate()
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        nine_b(gpu_memory_utilization=1.5).validate()


def test_workers_sharing_a_gpu_need_shares_that_fit_it_together():
    def worker(name, gpus=("0",), **budget):
        return PlannedWorker(name, nine_b(**budget), gpus)

    check_sharing([worker("prefill-0"), worker("decode-0", ("1",))])  # a GPU each: 85 % of its free memory
    with pytest.raises(mb.MemoryBudgetError, match=r"prefill-0, decode-0 share GPU 0, and decode-0 would size"):
        check_sharing([worker("prefill-0", num_kv_pages=1000), worker("decode-0")])
    with pytest.raises(mb.MemoryBudgetError, match=r"add up to 1.1 \(0.5 \+ 0.6\), over the whole GPU"):
        check_sharing([worker("prefill-0", gpu_memory_utilization=0.5), worker("decode-0", gpu_memory_utilization=0.6)])


def test_serve_gives_each_role_its_budget_and_plans_1p_1d_on_one_gpu():
    import json

    from deltamesh.services import cli
    from deltamesh.services.common.options import SETTINGS_ENV

    argv = ["--device", "cuda", "--gpus", "0", "--gpu-memory-utilization", "0.3", "--decode-gpu-memory-utilization"]
    command = typer_command("serve")
    values = dict(command.make_context("serve", [*argv, "0.6", "--decode-kv-cache-memory-gb", "20"]).params)
    secret = "s" * 32
    planned = cli._planned(values, secret, ["prefill", "decode"], values["gpus"])
    assert [(w.name, w.gpus, w.engine.gpu_memory_utilization, w.engine.kv_cache_memory_gb) for w in planned] == [
        ("prefill-0", ("0",), 0.3, None),
        ("decode-0", ("0",), 0.6, 20.0),
    ]
    check_sharing(planned)  # 0.3 + 0.6 of GPU 0
    specs, _ = cli._children(values, secret, *cli._plan(values, secret))
    handed = {s.name: json.loads(s.env[SETTINGS_ENV])["engine"] for s in specs[1:]}
    assert (handed["prefill-0"]["gpu_memory_utilization"], handed["prefill-0"].get("kv_cache_memory_gb")) == (0.3, None)
    assert (handed["decode-0"]["gpu_memory_utilization"], handed["decode-0"]["kv_cache_memory_gb"]) == (0.6, 20.0)
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in specs[1:]} == {"0"}


def test_serve_refuses_a_budget_that_holds_no_request_in_one_line_before_starting_anything():
    import subprocess
    import sys
    import time

    from test_cli_refusals import ROUTER_PORTS_LATER

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "deltamesh.services.cli", "serve", "--decode-kv-cache-memory-gb", "0.001"]
        + ROUTER_PORTS_LATER,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"DELTAMESH_MESH_SECRET": "s" * 32, "PATH": "/usr/bin:/bin"},
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("deltamesh serve: decode-0: --kv-cache-memory-gb 0.001 holds 32 KV pages")
    assert "router" not in done.stdout  # nothing was started: no child printed a line
    assert time.monotonic() - started < 60  # imports only (a generous bound: a shared 2-core machine)


def typer_command(name: str):
    import typer

    from deltamesh.services.cli import app

    return typer.main.get_command(app).commands[name]

"""What the GPU benchmarks add to bench/common.py: measured ceilings, the GPU's description, timing (wall clock
and CUDA events, eager or replayed from a CUDA graph), an engine core at a model's real shape with dummy weights,
the bytes a decode step must move and where a step's GPU time goes."""

from __future__ import annotations

import json
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench import common


@contextmanager
def few_token_fusions(on: bool):
    """The engine's few-token paths as it runs them (on), or off: every op its own kernel and cuBLAS for every
    plain projection, as before them (triton_fused_linear.FUSED_MAX_TOKENS and triton_gemv.SMALL_WEIGHT_MAX_TOKENS
    at 0; both are read at each call, so when CUDA graphs are captured)."""
    from deltamesh.kernels import triton_fused_linear, triton_gemv

    saved = triton_fused_linear.FUSED_MAX_TOKENS, triton_gemv.SMALL_WEIGHT_MAX_TOKENS
    if not on:
        triton_fused_linear.FUSED_MAX_TOKENS = triton_gemv.SMALL_WEIGHT_MAX_TOKENS = 0
    try:
        yield
    finally:
        triton_fused_linear.FUSED_MAX_TOKENS, triton_gemv.SMALL_WEIGHT_MAX_TOKENS = saved


def host_list(t: torch.Tensor) -> list:
    """`t.tolist()`, waiting for the GPU with the GIL released (as the engine waits for a step's tokens), so that
    a benchmark's event loop beside the GPU work keeps running."""
    if t.is_cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        done.synchronize()
    return t.tolist()


def hbm_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    return 2 * nbytes / (ms / 1e3)


def matmul_rate(n: int = 8192) -> float:
    """bf16 matrix-product rate in FLOP/s on random data."""
    from triton.testing import do_bench

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=20, rep=100, return_mode="median")
    return 2 * n**3 / (ms / 1e3)


def machine_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {
        **common.machine_info(),
        "gpu": p.name,
        "gpus": torch.cuda.device_count(),
        "sm": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
    }


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() (it synchronises on its own) after warm-up calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return common.median(times)


def gpu_ms(fn, iters: int = 20, before=None) -> float:
    """Median GPU time of fn() between CUDA events, after a warm-up call; `before` (a function) is launched ahead
    of each timed call, outside the events."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return common.median(times)


def pipelined_ms(fn, steps: int = 8, iters: int = 10) -> float:
    """Median GPU time per call of fn() launched `steps` times back to back with no read between them, as async
    scheduling runs a decode loop: timed from the end of one call launched first, so that no call waits for its
    host preparation on an idle GPU (the host prepares each while the GPU runs the one before)."""
    return gpu_ms(lambda: [fn() for _ in range(steps)], iters, before=fn) / steps


def graph_ms(fn) -> float:
    """GPU time of one replay of fn() captured in a CUDA graph (launch overhead as a decode step pays it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return gpu_ms(graph.replay)


def core_for(config_dir: str, max_seqs: int, context: int, extra_tokens: int = 64, **kw):
    """An EngineCore on the GPU with dummy bf16 weights, its pools sized for `max_seqs` requests of `context`
    (+ `extra_tokens`) tokens; no prefix cache (these benchmarks time the engine's own steps)."""
    from deltamesh.engine import EngineConfig
    from deltamesh.engine.core import EngineCore

    pages = max_seqs * (-(-(context + extra_tokens) // 16)) + 64
    return EngineCore(
        EngineConfig(
            model=config_dir,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max_seqs,
            num_kv_pages=pages,
            max_model_len=context + extra_tokens,
            **{"prefix_cache": False, "max_num_batched_tokens": max(8192, context)} | kw,
        )
    )


def step_bytes(core, batch: int, context: int) -> dict[str, int]:
    """Bytes a decode step must move: every weight but the embedding table (a step reads `batch` rows of it),
    every request's KV, its GDN state read and written."""
    m = core.model
    weights = sum(p.numel() * p.element_size() for p in m.parameters() if p is not m.embed or m.lm_head is m.embed)
    weights += batch * m.embed.shape[1] * m.embed.element_size()
    kv_per_token = core.kv_pool.page_bytes // core.kv_pool.page_size
    state = core.state_pool.slot_bytes
    return {"weights": weights, "kv": batch * context * kv_per_token, "state": 2 * batch * state}


KERNEL_GROUPS = [  # (group, regex over CUDA kernel names), first match wins
    ("fused MoE (Triton)", r"^_route|^_align|^_scatter|^_gate_up_silu|^_down"),
    ("GDN recurrence", r"gdn|gated_delta|delta_rule|recurrent|gates"),
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|grouped_mm"),
    ("paged attention", r"decode_split|merge_splits"),
    ("attention inputs / gate", r"attention_inputs|sigmoid_gate"),
    ("conv1d", r"conv1d"),
    ("norms", r"rms_norm"),
    ("silu*mul", r"silu_mul"),
    ("kv write / index", r"index|scatter|gather"),
    ("copies", r"copy|memcpy|memset|cat"),
]


def timeline_gaps(kernels: list[tuple[str, float, float]], steps: int, top: int = 12) -> dict:
    """Where a stream of kernels leaves the GPU idle: `kernels` as (name, start us, duration us) of `steps` steps
    launched back to back. Per step: the span from the first kernel's start to the last one's end, the time some
    kernel ran (overlaps counted once) and the rest (idle); and the `top` kernel names after which the GPU idled
    longest in all (the gap from the end of the kernel that ended last up to the next kernel's start, per step),
    with their counts and largest gap; and the `top` kernel names launched most often (`frequent`: launches and
    µs per step, µs a launch), where fusing small kernels would save launches."""
    spans = sorted((start, start + dur, name) for name, start, dur in kernels)
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "kernels": 0, "after": [], "frequent": []}
    busy, end, last = 0.0, spans[0][0], spans[0][2]  # last: the kernel that ended last so far
    after: dict[str, dict] = {}
    for i, (start, stop, name) in enumerate(spans):
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, last = stop, name
        if i + 1 < len(spans) and spans[i + 1][0] > end:
            gap = spans[i + 1][0] - end
            row = after.setdefault(last, {"kernel": last[:90], "gaps": 0, "ms": 0.0, "largest_us": 0.0})
            row["gaps"] += 1
            row["ms"] += gap / 1e3
            row["largest_us"] = max(row["largest_us"], gap)
    span = end - spans[0][0]
    rows = sorted(after.values(), key=lambda r: -r["ms"])[:top]
    for r in rows:
        r["gaps"], r["ms"] = r["gaps"] / steps, r["ms"] / steps
    launched: dict[str, list[float]] = {}
    for start, stop, name in spans:
        launched.setdefault(name, []).append(stop - start)
    frequent = [
        {"kernel": name[:90], "launches": len(d) / steps, "us": sum(d) / steps, "us_each": sum(d) / len(d)}
        for name, d in sorted(launched.items(), key=lambda kv: -len(kv[1]))[:top]
    ]
    return {
        "span_ms": span / steps / 1e3,
        "busy_ms": busy / steps / 1e3,
        "idle_ms": (span - busy) / steps / 1e3,
        "kernels": len(spans) / steps,
        "after": rows,
        "frequent": frequent,
    }


def trace_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every kernel, copy and fill on the GPU in a torch profiler's record."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in events if e.get("cat") in gpu and "ts" in e]


def profiled_steps(core, items, steps: int, step=None):
    """The torch profiler's record (CUDA activity) of `steps` eager steps of `items`, after one warm-up step; `step`
    (a function of no arguments) profiles that instead, as it runs (a graph's replay: the kernels it launches)."""
    from torch.profiler import ProfilerActivity, profile

    r = core.runner
    if step is None:
        input_ids, batch = r.prepare(items)

        def step():
            with torch.inference_mode():
                r.model.logits(r.model(input_ids, batch, r.kv_pool, r.state_pool, r.kernels))

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof


def kernel_breakdown(
    core, items, steps: int = 3, top: int = 25, step=None, timeline: dict | None = None
) -> tuple[list[dict], list[dict]]:
    """CUDA time per kernel of eager steps of `items` (the kernels a graph replays), or of `step`, grouped by
    KERNEL_GROUPS: (groups, the `top` slowest kernels). `timeline`: a dict that receives the steps' timeline_gaps
    (the steps run back to back: the idle time between kernels and what came before it)."""
    prof = profiled_steps(core, items, steps, step)
    if timeline is not None:
        timeline.update(timeline_gaps(trace_kernels(prof), steps))
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            kernels.append({"kernel": e.key[:90], "calls": e.count // steps, "ms": us / steps / 1e3})
    kernels.sort(key=lambda k: -k["ms"])
    groups: dict[str, dict] = {}
    for k in kernels:
        name = next((g for g, rx in KERNEL_GROUPS if re.search(rx, k["kernel"], re.I)), "other elementwise")
        grp = groups.setdefault(name, {"group": name, "kernels": 0, "calls": 0, "ms": 0.0})
        grp["kernels"] += 1
        grp["calls"] += k["calls"]
        grp["ms"] += k["ms"]
    return sorted(groups.values(), key=lambda g: -g["ms"]), kernels[:top]

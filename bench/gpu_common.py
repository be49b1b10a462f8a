"""What the GPU benchmarks add to bench/common.py: measured ceilings, the GPU's description, a table of
result rows."""

from __future__ import annotations

import torch

from bench import common


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
        **common.machine_info(), "date": common.utc_now(), "gpu": p.name, "gpus": torch.cuda.device_count(),
        "sm": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1), "cuda": torch.version.cuda,
    }  # fmt: skip


def print_table(rows: list[dict], cols: list[str]) -> None:
    print(common.table(cols, [[r.get(c) for c in cols] for r in rows]))

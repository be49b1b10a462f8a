"""Helpers shared by the GPU benchmarks: measured ceilings, machine facts, a printed table."""

from __future__ import annotations

import datetime
import platform

import torch


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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": p.name, "gpus": torch.cuda.device_count(), "sm": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }  # fmt: skip


def print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))

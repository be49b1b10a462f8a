"""Programmatic dependent launch (PDL; deltamesh/kernels/pdl.py), probed on its own: does letting a kernel launch
while the one before it drains save the idle time a batch-1 step loses at each of its kernel boundaries
(bench/RESULTS.md, "Steps back to back" and "Programmatic dependent launch")? Its variants are the engine's modes.

A chain as a batch-1 decode step has it, captured in one CUDA graph: `--pairs` times a one-token GEMV over a
2048 x 4096 bf16 weight (each its own weight, from a ring larger than the L2 cache, as a step reads them) followed
by a one-program RMSNorm of its output that feeds the next GEMV. Variants:

- `off`: plain launches (each kernel starts after the one before has ended);
- `wait`: every kernel launched with PDL and waiting (griddepcontrol.wait) before it reads anything;
- `prefetch`: as `wait`, but the GEMV loads its first weight tile before it waits (weights do not depend on the
  kernel before), so its HBM traffic can start during the previous kernel's tail;
- `trigger`: as `prefetch`, and each kernel lets its dependent launch (griddepcontrol.launch_dependents) once it
  has loaded its inputs.

Every variant's output is checked against `off`'s. GPU only.

    python bench/gpu_pdl.py --out bench/results/gpu_pdl.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, print_table, write_result
from bench.gpu_common import graph_ms, hbm_bandwidth, machine_info

VARIANTS = ("off", "wait", "prefetch", "trigger")
N, K, BLOCK_N, BLOCK_K = 2048, 4096, 16, 512


@triton.jit
def _gemv(w, x, y, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    """y[n] = sum_k w[n, k] x[k] for BLOCK_N rows; MODE 0 off, 1 wait, 2 prefetch, 3 trigger."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
    first = tl.load(w + n[:, None] * K + k[None, :])  # weights: nothing the kernel before writes
    if MODE >= 2:
        tl.extra.cuda.gdc_wait()
    a = tl.load(x + k).to(tl.float32)
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc += tl.sum(first.to(tl.float32) * a[None, :], 1)
    for start in range(BLOCK_K, K, BLOCK_K):
        tile = tl.load(w + n[:, None] * K + start + k[None, :]).to(tl.float32)
        acc += tl.sum(tile * tl.load(x + start + k).to(tl.float32)[None, :], 1)
    tl.store(y + n, acc.to(y.dtype.element_ty))


@triton.jit
def _norm(y, x, BLOCK: tl.constexpr, MODE: tl.constexpr):
    """x[:K] = RMSNorm of y (N values), tiled to K: the next GEMV's input."""
    if MODE >= 1:
        tl.extra.cuda.gdc_wait()
    i = tl.arange(0, BLOCK)
    v = tl.load(y + i).to(tl.float32)
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    v = v * tl.rsqrt(tl.sum(v * v, 0) / BLOCK + 1e-6)
    tl.store(x + i, v.to(x.dtype.element_ty))
    tl.store(x + BLOCK + i, v.to(x.dtype.element_ty))


def chain(weights: list[torch.Tensor], x0: torch.Tensor, pairs: int, mode: int):
    x, y = x0.clone(), torch.empty(N, dtype=x0.dtype, device=x0.device)
    pdl = mode > 0

    def run():
        x.copy_(x0)
        for i in range(pairs):
            _gemv[(N // BLOCK_N,)](weights[i % len(weights)], x, y, K, BLOCK_N, BLOCK_K, mode, launch_pdl=pdl)
            _norm[(1,)](y, x, N, mode, launch_pdl=pdl)

    return run, x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=200, help="GEMV + norm pairs in the graph")
    p.add_argument("--ring-gb", type=float, default=1.0, help="distinct weights, in GB (several times the L2)")
    p.add_argument("--out", default=str(RESULTS / "gpu_pdl.json"))
    args = p.parse_args()
    assert K == 2 * N, "the norm tiles its N outputs twice into the next K inputs"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ring = max(1, int(args.ring_gb * 1e9 // (N * K * 2)))
    weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64 for _ in range(ring)]
    x0 = torch.randn(K, device=dev, dtype=torch.bfloat16)
    bandwidth = hbm_bandwidth()
    floor_us = (N * K * 2) / bandwidth * 1e6
    rows, reference = [], None
    for mode, name in enumerate(VARIANTS):
        run, x = chain(weights, x0, args.pairs, mode)
        ms = graph_ms(run)
        run()
        torch.cuda.synchronize()
        reference = x.clone() if reference is None else reference
        rows.append(
            {
                "variant": name,
                "graph_ms": ms,
                "us_per_pair": ms * 1e3 / args.pairs,
                "gemv_floor_us": floor_us,
                "same_as_off": bool(torch.equal(x, reference)),
            }
        )
    base = rows[0]["us_per_pair"]
    for r in rows:
        r["saved_us_per_pair"] = base - r["us_per_pair"]
    print_table(rows, ["variant", "graph_ms", "us_per_pair", "saved_us_per_pair", "gemv_floor_us", "same_as_off"])
    write_result(args.out, {"benchmark": "gpu_pdl", "pairs": args.pairs, "ring": ring, "rows": rows}, machine_info())


if __name__ == "__main__":
    main()

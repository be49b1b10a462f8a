"""Kernel tables on one GPU — medians of `triton.testing.do_bench`:

- GDN: the project's registry path vs FlashInfer called directly vs FLA, next to the HBM floor (decode).
  Shapes: Qwen3.5-9B/35B GDN (HK 16, HV 32, d 128) and the 397B head shape (HK 16, HV 64); fp32 state.
- Paged decode attention (`--attention`): the Triton kernel on the Qwen3.5-9B attention shape (16 query /
  4 KV heads of 256, 16-token pages of the engine's page-major pool, pages in random order) at ~9k
  tokens of context and batch 64 / 256, then the 35B-A3B shape's (2 KV heads) at 8k and batch 1 / 4, over a
  sweep of its launch settings (more splits at the small batches), against the HBM floor of the KV bytes it reads.

    python bench/gpu_kernels.py --out bench/results/gpu_kernels.json
    python bench/gpu_kernels.py --attention --no-gdn --out bench/results/gpu_attention.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, print_table, write_result
from bench.gpu_common import hbm_bandwidth, machine_info
from deltamesh.kernels import ModelShapes
from deltamesh.kernels.registry import _BACKENDS

DEV = torch.device("cuda")


def bench(fn) -> float:
    from triton.testing import do_bench

    for _ in range(5):  # compile (CuTe DSL / Triton) and clock ramp-up stay out of the numbers
        fn()
    torch.cuda.synchronize()
    return min(do_bench(fn, warmup=50, rep=200, return_mode="median") for _ in range(2))


def inputs(lens, hk, hv, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lens)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    q, k, v = r(t, hk, 128).bfloat16(), r(t, hk, 128).bfloat16(), r(t, hv, 128).bfloat16()
    a, b = r(t, hv).bfloat16(), r(t, hv).bfloat16()
    A_log, dt_bias = torch.empty(hv, device=DEV).uniform_(-2, 1.5, generator=g), r(hv) * 0.5
    pool = r(len(lens) + 1, hv, 128, 128) * 0.05
    idx = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, k, v, a, b, A_log, dt_bias, pool, idx, cu


def prefill_rows(name, lens, hk, hv):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from flashinfer import chunk_gated_delta_rule as fi_chunk

    shapes = ModelShapes(torch.bfloat16, torch.float32, hk, hv, 128, 128, 16, 4, 256, 16)
    registry = _BACKENDS["flashinfer"].load(DEV, shapes)[0]["gdn_prefill"]
    q, k, v, a, b, A_log, dt_bias, pool, idx, cu = inputs(lens, hk, hv)
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    alpha, beta = g.exp(), torch.sigmoid(b.float())
    dense = pool[idx.long()].clone()
    cu64 = cu.long()
    cu_cpu = cu64.cpu()
    t_reg = bench(lambda: registry(q, k, v, a, b, A_log, dt_bias, lens, cu, pool, idx))
    t_fi = bench(
        lambda: fi_chunk(
            q,
            k,
            v,
            g=alpha,
            beta=beta,
            initial_state=pool,
            output_state=pool,
            state_indices=idx,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
            max_seqlen=max(lens),
        )
    )
    t_fla = bench(
        lambda: fla_chunk(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            initial_state=dense,
            output_final_state=True,
            cu_seqlens=cu64,
            cu_seqlens_cpu=cu_cpu,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        )
    )
    return {
        "op": "prefill",
        "case": name,
        "registry_ms": t_reg,
        "flashinfer_ms": t_fi,
        "fla_ms": t_fla,
        "registry_vs_flashinfer": t_fi / t_reg,
    }


def decode_rows(batch, hk, hv, state_dtype, bandwidth):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as fi_decode

    shapes = ModelShapes(torch.bfloat16, state_dtype, hk, hv, 128, 128, 16, 4, 256, 16)
    registry = _BACKENDS["flashinfer"].load(DEV, shapes)[0]["gdn_decode"]
    q, k, v, a, b, A_log, dt_bias, pool, idx, _ = inputs([1] * batch, hk, hv, seed=1)
    pool = pool.to(state_dtype)
    t_reg = bench(lambda: registry(q, k, v, a, b, A_log, dt_bias, pool, idx))
    t_fi = bench(
        lambda: fi_decode(
            q[:, None],
            k[:, None],
            v[:, None],
            None,
            A_log,
            a[:, None],
            dt_bias,
            b[:, None],
            initial_state=pool,
            initial_state_indices=idx,
            use_qk_l2norm=True,
        )
    )
    dense = pool[idx.long()].float()
    t_fla = bench(
        lambda: fla_recurrent(
            q[:, None],
            k[:, None],
            v[:, None],
            g=a[:, None],
            beta=b[:, None],
            initial_state=dense,
            output_final_state=True,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
        )
    )
    state_bytes = 2 * batch * hv * 128 * 128 * pool.element_size()  # read + write
    io_bytes = batch * (2 * hk + 2 * hv) * 128 * 2
    floor_ms = (state_bytes + io_bytes) / bandwidth * 1e3
    return {
        "op": "decode",
        "case": f"B={batch} state={str(state_dtype)[6:]}",
        "registry_ms": t_reg,
        "flashinfer_ms": t_fi,
        "fla_ms": t_fla,
        "hbm_floor_ms": floor_ms,
        "registry_vs_flashinfer": t_fi / t_reg,
        "registry_vs_floor": floor_ms / t_reg,
    }


def attention_rows(batch: int, context: int, bandwidth: float, launches, kv_heads: int = 4) -> list[dict]:
    """The paged decode kernel on a pool laid out as the engine's (8 attention layers, page-major); 16 query heads
    of 256 over `kv_heads` (4: the 9B shape, 2: the 35B-A3B shape)."""
    from deltamesh.kernels.triton_attention import paged_decode

    page, heads, dim, layers = 16, 16, 256, 8
    n_pages = -(-context // page)
    g = torch.Generator(device=DEV).manual_seed(batch)
    pool = torch.empty(batch * n_pages + 1, layers, 2, page, kv_heads, dim, dtype=torch.bfloat16, device=DEV)
    pool.normal_(generator=g)
    k_cache, v_cache = pool[:, 3, 0], pool[:, 3, 1]
    order = torch.randperm(batch * n_pages, device=DEV, generator=g) + 1
    tables = order.view(batch, n_pages).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, heads, dim, generator=g, device=DEV).bfloat16()
    floor_ms = batch * context * 2 * kv_heads * dim * 2 / bandwidth * 1e3
    ref = paged_decode(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, launches[0])
    rows = []
    for launch in launches:
        out = paged_decode(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, launch)
        agree = float((out.float() - ref.float()).abs().max())
        ms = bench(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, launch))
        rows.append(
            {
                "op": "paged decode attention",
                "case": f"B={batch} ctx={context} kv_heads={kv_heads}",
                "block_n": launch.block_n,
                "warps": launch.num_warps,
                "stages": launch.num_stages,
                "splits": launch.splits(batch, kv_heads),
                "ms": ms,
                "hbm_floor_ms": floor_ms,
                "of_floor": floor_ms / ms,
                "max_diff_vs_first": agree,
            }
        )
    del pool
    torch.cuda.empty_cache()
    return rows


def attention_launches() -> list:
    from deltamesh.kernels.triton_attention import DEFAULT_LAUNCH, DecodeLaunch

    sweep = [
        DecodeLaunch(block_n=n, num_warps=w, num_stages=st, target_programs=tp)
        for n in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3)
        for tp in (2048, 8192)
    ]
    one_page = DecodeLaunch(block_n=16, num_warps=4, num_stages=3, target_programs=1024, max_splits=16)
    return [DEFAULT_LAUNCH, one_page] + [x for x in sweep if x != DEFAULT_LAUNCH]


def few_sequence_launches() -> list:
    """At batch 1-4 with 2 KV heads the default's 32 splits give 64-256 programs, under two per SM (what that costs
    a 35B-A3B batch-1 step: bench/RESULTS.md, fused projections). More splits, and smaller tiles per program."""
    from deltamesh.kernels.triton_attention import DEFAULT_LAUNCH, DecodeLaunch

    sweep = [
        DecodeLaunch(block_n=n, num_warps=w, num_stages=st, target_programs=8192, max_splits=ms)
        for n in (16, 32, 64)
        for w in (2, 4)
        for st in (2, 3)
        for ms in (64, 128, 256)
    ]
    return [DEFAULT_LAUNCH, *sweep]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / "gpu_kernels.json"))
    p.add_argument("--attention", action="store_true", help="add the paged decode attention sweep")
    p.add_argument("--no-gdn", action="store_true", help="skip the GDN table")
    args = p.parse_args()
    bandwidth = hbm_bandwidth()
    rows = []
    if not args.no_gdn:
        rows += [
            prefill_rows("1x8192", [8192], 16, 32),
            prefill_rows("16x512", [512] * 16, 16, 32),
            prefill_rows("8x8192", [8192] * 8, 16, 32),
            prefill_rows("397B heads 1x8192 (HK16/HV64)", [8192], 16, 64),
            decode_rows(64, 16, 32, torch.float32, bandwidth),
            decode_rows(256, 16, 32, torch.float32, bandwidth),
            decode_rows(256, 16, 32, torch.bfloat16, bandwidth),
        ]
        print_table(
            rows,
            [
                "op",
                "case",
                "registry_ms",
                "flashinfer_ms",
                "fla_ms",
                "hbm_floor_ms",
                "registry_vs_flashinfer",
                "registry_vs_floor",
            ],
        )
    if args.attention:
        attn = []
        for batch in (64, 256):
            attn += attention_rows(batch, 9216, bandwidth, attention_launches())
        for batch in (1, 4):  # the 35B-A3B shape's attention at batch 1 and 4, 8k tokens of context
            attn += attention_rows(batch, 8192, bandwidth, few_sequence_launches(), kv_heads=2)
        print_table(
            attn,
            [
                "op",
                "case",
                "block_n",
                "warps",
                "stages",
                "splits",
                "ms",
                "hbm_floor_ms",
                "of_floor",
                "max_diff_vs_first",
            ],
        )
        rows += attn
    write_result(args.out, {"hbm_copy_bytes_per_s": bandwidth, "rows": rows}, machine_info())


if __name__ == "__main__":
    main()

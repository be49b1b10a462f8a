"""GDN kernel table on one GPU: the project's registry path vs FlashInfer called directly vs FLA, next to
the HBM floor (decode) — medians of `triton.testing.do_bench`.

    python bench/gpu_kernels.py --out bench/results/gpu_kernels.json

Shapes: Qwen3.5-9B/35B GDN (HK 16, HV 32, d 128) and the 397B head shape (HK 16, HV 64); fp32 state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import hbm_bandwidth, machine_info, print_table  # noqa: E402
from kernels import ModelShapes  # noqa: E402
from kernels.registry import _BACKENDS  # noqa: E402

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
    t_fi = bench(lambda: fi_chunk(q, k, v, g=alpha, beta=beta, initial_state=pool, output_state=pool, state_indices=idx,
                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_seqlen=max(lens)))  # fmt: skip
    t_fla = bench(lambda: fla_chunk(q[None], k[None], v[None], g[None], beta[None], initial_state=dense,
                                    output_final_state=True, cu_seqlens=cu64, cu_seqlens_cpu=cu_cpu,
                                    use_qk_l2norm_in_kernel=True, state_v_first=True))  # fmt: skip
    return {"op": "prefill", "case": name, "registry_ms": t_reg, "flashinfer_ms": t_fi, "fla_ms": t_fla,
            "registry_vs_flashinfer": t_fi / t_reg}  # fmt: skip


def decode_rows(batch, hk, hv, state_dtype, bandwidth):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as fi_decode

    shapes = ModelShapes(torch.bfloat16, state_dtype, hk, hv, 128, 128, 16, 4, 256, 16)
    registry = _BACKENDS["flashinfer"].load(DEV, shapes)[0]["gdn_decode"]
    q, k, v, a, b, A_log, dt_bias, pool, idx, _ = inputs([1] * batch, hk, hv, seed=1)
    pool = pool.to(state_dtype)
    t_reg = bench(lambda: registry(q, k, v, a, b, A_log, dt_bias, pool, idx))
    t_fi = bench(lambda: fi_decode(q[:, None], k[:, None], v[:, None], None, A_log, a[:, None], dt_bias, b[:, None],
                                   initial_state=pool, initial_state_indices=idx, use_qk_l2norm=True))  # fmt: skip
    dense = pool[idx.long()].float()
    t_fla = bench(lambda: fla_recurrent(q[:, None], k[:, None], v[:, None], g=a[:, None], beta=b[:, None],
                                        initial_state=dense, output_final_state=True, use_gate_in_kernel=True,
                                        A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                                        use_qk_l2norm_in_kernel=True, state_v_first=True))  # fmt: skip
    state_bytes = 2 * batch * hv * 128 * 128 * pool.element_size()  # read + write
    io_bytes = batch * (2 * hk + 2 * hv) * 128 * 2
    floor_ms = (state_bytes + io_bytes) / bandwidth * 1e3
    return {"op": "decode", "case": f"B={batch} state={str(state_dtype)[6:]}", "registry_ms": t_reg,
            "flashinfer_ms": t_fi, "fla_ms": t_fla, "hbm_floor_ms": floor_ms, "registry_vs_flashinfer": t_fi / t_reg,
            "registry_vs_floor": floor_ms / t_reg}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gpu_kernels.json")
    args = p.parse_args()
    bandwidth = hbm_bandwidth()
    rows = [
        prefill_rows("1x8192", [8192], 16, 32),
        prefill_rows("16x512", [512] * 16, 16, 32),
        prefill_rows("8x8192", [8192] * 8, 16, 32),
        prefill_rows("397B heads 1x8192 (HK16/HV64)", [8192], 16, 64),
        decode_rows(64, 16, 32, torch.float32, bandwidth),
        decode_rows(256, 16, 32, torch.float32, bandwidth),
        decode_rows(256, 16, 32, torch.bfloat16, bandwidth),
    ]
    print_table(rows, ["op", "case", "registry_ms", "flashinfer_ms", "fla_ms", "hbm_floor_ms", "registry_vs_flashinfer",
                       "registry_vs_floor"])  # fmt: skip
    out = {"command": " ".join(sys.argv), "machine": machine_info(), "hbm_copy_bytes_per_s": bandwidth, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""GPU backends against the CPU reference / a float64 recurrence, on the real Qwen3.5 shapes
(HK 16, HV 32, head dim 128 for GDN; 16 query / 4 KV heads of 256 for attention). Skipped without CUDA."""

import pytest
import torch

from kernels import ModelShapes, torch_ref
from kernels.batch import StepBatch
from kernels.registry import _BACKENDS

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES = ModelShapes(torch.bfloat16, torch.float32, 16, 32, 128, 128, 16, 4, 256, 16)


def backend(name, shapes=SHAPES):
    ops, why = _BACKENDS[name].load(DEV, shapes)
    if not ops:
        pytest.skip(f"{name}: {why}")
    return ops


def rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "NaN/inf"
    return ((out - ref).norm() / ref.norm()).item()


def gdn_inputs(lens, seed=0, state_dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lens)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    q, k, v = (r(t, 16, 128).bfloat16(), r(t, 16, 128).bfloat16(), r(t, 32, 128).bfloat16())
    a, b = r(t, 32).bfloat16(), (r(t, 32) * 2).bfloat16()
    A_log, dt_bias = torch.empty(32, device=DEV).uniform_(-2, 1.5, generator=g), r(32) * 0.5
    pool = (r(len(lens) + 4, 32, 128, 128) * 0.1).to(state_dtype)
    idx = torch.randperm(len(lens) + 4, generator=torch.Generator().manual_seed(seed))[: len(lens)].to(DEV)
    return q, k, v, a, b, A_log, dt_bias, pool, idx


def reference_prefill(q, k, v, a, b, A_log, dt_bias, lens, pool, idx):
    """The torch reference in float64 on the CPU."""
    cpu = lambda x: x.double().cpu()  # noqa: E731
    ref_pool = cpu(pool)
    out = torch_ref.gdn_prefill(cpu(q), cpu(k), cpu(v), cpu(a), cpu(b), cpu(A_log), cpu(dt_bias), lens, None, ref_pool,
                                idx.cpu())
    return out, ref_pool


@pytest.mark.parametrize("name", ["flashinfer", "fla"])
def test_gdn_prefill_backends_match_float64(name):
    ops = backend(name)
    lens = [1, 100, 700, 64]
    q, k, v, a, b, A_log, dt_bias, pool, idx = gdn_inputs(lens)
    ref_out, ref_pool = reference_prefill(q, k, v, a, b, A_log, dt_bias, lens, pool, idx)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    out = ops["gdn_prefill"](q, k, v, a, b, A_log, dt_bias, lens, cu, pool, idx.to(torch.int32))
    torch.cuda.synchronize()
    assert rel(out, ref_out) <= 1e-2
    assert rel(pool[idx], ref_pool[idx.cpu()]) <= 1e-2


@pytest.mark.parametrize("name,state_dtype", [("flashinfer", torch.float32), ("flashinfer", torch.bfloat16),
                                              ("fla", torch.float32)])  # fmt: skip
def test_gdn_decode_backends_match_float64(name, state_dtype):
    ops = backend(name, ModelShapes(torch.bfloat16, state_dtype, 16, 32, 128, 128, 16, 4, 256, 16))
    lens = [1] * 64
    q, k, v, a, b, A_log, dt_bias, pool, idx = gdn_inputs(lens, seed=1, state_dtype=state_dtype)
    cpu = lambda x: x.double().cpu()  # noqa: E731
    ref_pool = cpu(pool)
    ref = torch_ref.gdn_decode(cpu(q), cpu(k), cpu(v), cpu(a), cpu(b), cpu(A_log), cpu(dt_bias), ref_pool, idx.cpu())
    out = ops["gdn_decode"](q, k, v, a, b, A_log, dt_bias, pool, idx.to(torch.int32))
    torch.cuda.synchronize()
    assert rel(out, ref) <= 1e-2
    assert rel(pool[idx], ref_pool[idx.cpu()]) <= 1e-2


def test_triton_paged_attention_matches_reference():
    ops = backend("triton")
    g = torch.Generator(device=DEV).manual_seed(2)
    pages, ps, hkv, d, hq = 64, 16, 4, 256, 16
    pool = torch.randn(pages, 3, 2, ps, hkv, d, generator=g, device=DEV).bfloat16()
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    ctx, qlen = [500, 37, 0, 90], [1, 1, 40, 23]  # two decodes, a fresh prefill, a continued chunk
    tables = torch.full((4, 40), -1, dtype=torch.int32, device=DEV)
    perm = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(0)) + 1
    used = 0
    for i, (c, n) in enumerate(zip(ctx, qlen)):
        need = -(-(c + n) // ps)
        tables[i, :need] = perm[used : used + need].to(DEV, torch.int32)
        used += need
    q = torch.randn(sum(qlen), hq, d, generator=g, device=DEV).bfloat16()
    seq = torch.tensor([c + n for c, n in zip(ctx, qlen)], dtype=torch.int32, device=DEV)
    batch = StepBatch(2, qlen, ctx, seq, tables,
                      torch.zeros(65, dtype=torch.long, device=DEV), torch.arange(4, device=DEV),
                      torch.zeros(65, dtype=torch.long, device=DEV))  # fmt: skip
    out = ops["paged_attention"](q, k_cache, v_cache, batch, d**-0.5)
    cpu_batch = StepBatch(2, qlen, ctx, seq.cpu(), tables.cpu(), batch.slot_mapping.cpu(),
                          batch.state_slots.cpu(), batch.positions.cpu())  # fmt: skip
    ref = torch_ref.paged_attention(q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(), cpu_batch, d**-0.5)
    assert rel(out, ref) <= 1e-2

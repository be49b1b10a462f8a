"""GPU backends against the CPU reference / a float64 recurrence, on the real Qwen3.5 shapes
(HK 16, HV 32, head dim 128 for GDN; 16 query / 4 KV heads of 256 for attention). Skipped without CUDA."""

import pytest
import torch

from deltamesh.kernels import ModelShapes, torch_ref
from deltamesh.kernels.batch import StepBatch
from deltamesh.kernels.registry import _BACKENDS

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
    out = torch_ref.gdn_prefill(
        cpu(q), cpu(k), cpu(v), cpu(a), cpu(b), cpu(A_log), cpu(dt_bias), lens, None, ref_pool, idx.cpu()
    )
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


@pytest.mark.parametrize(
    "name,state_dtype", [("flashinfer", torch.float32), ("flashinfer", torch.bfloat16), ("fla", torch.float32)]
)
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
    pages, ps, hkv, d, hq = 300, 16, 4, 256, 16
    pool = torch.randn(pages, 3, 2, ps, hkv, d, generator=g, device=DEV).bfloat16()
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    ctx, qlen = [3000, 37, 0, 90], [1, 1, 40, 23]  # two decodes, a fresh prefill, a continued chunk
    tables = torch.full((4, 200), -1, dtype=torch.int32, device=DEV)
    perm = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(0)) + 1
    used = 0
    for i, (c, n) in enumerate(zip(ctx, qlen)):
        need = -(-(c + n) // ps)
        tables[i, :need] = perm[used : used + need].to(DEV, torch.int32)
        used += need
    q = torch.randn(sum(qlen), hq, d, generator=g, device=DEV).bfloat16()
    seq = torch.tensor([c + n for c, n in zip(ctx, qlen)], dtype=torch.int32, device=DEV)
    batch = StepBatch(
        2,
        qlen,
        ctx,
        seq,
        tables,
        torch.zeros(sum(qlen), dtype=torch.long, device=DEV),
        torch.arange(4, device=DEV),
        torch.zeros(sum(qlen), dtype=torch.long, device=DEV),
    )
    out = ops["paged_attention"](q, k_cache, v_cache, batch, d**-0.5)
    cpu_batch = StepBatch(
        2, qlen, ctx, seq.cpu(), tables.cpu(), batch.slot_mapping.cpu(), batch.state_slots.cpu(), batch.positions.cpu()
    )
    ref = torch_ref.paged_attention(
        q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu(), cpu_batch, d**-0.5
    )
    assert rel(out, ref) <= 1e-2


def test_triton_fused_ops_match_reference():
    """Norms, SwiGLU and the conv1d decode step in bf16 on the GPU vs the torch reference in float64."""
    ops = backend("triton")
    g = torch.Generator(device=DEV).manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    f64 = lambda x: x.double().cpu()  # noqa: E731
    x, res, w = r(64, 4096).bfloat16(), r(64, 4096).bfloat16(), (r(4096) * 0.1).bfloat16()
    normed, total = ops["add_rms_norm"](x, res, w, 1e-6)
    ref_normed, ref_total = torch_ref.add_rms_norm(f64(x), f64(res), f64(w), 1e-6)
    assert rel(total, ref_total) <= 1e-2 and rel(normed, ref_normed) <= 1e-2
    qk = r(64, 3, 16, 256).bfloat16()[:, 1]  # per-head view with gaps, as q/k norm sees it
    assert rel(ops["rms_norm"](qk, w[:256], 1e-6), torch_ref.rms_norm(f64(qk), f64(w[:256]), 1e-6)) <= 1e-2
    core, z = r(64, 32, 128).bfloat16(), r(64, 8192).bfloat16()[:, 4096:].view(64, 32, 128)
    got = ops["gated_rms_norm"](core, z, w[:128], 1e-6)
    assert rel(got, torch_ref.gated_rms_norm(f64(core), f64(z), f64(w[:128]), 1e-6)) <= 1e-2
    gate_up = r(64, 2 * 12288).bfloat16()
    assert rel(ops["silu_mul"](gate_up), torch_ref.silu_mul(f64(gate_up))) <= 1e-2
    pool, idx = r(80, 8192, 3).bfloat16(), torch.randperm(80, device=DEV)[:64]
    xin, cw = r(64, 8192 + 100).bfloat16()[:, :8192], r(8192, 4).bfloat16()
    ref_pool = f64(pool)
    ref = torch_ref.conv1d_update(f64(xin), ref_pool, idx.cpu(), f64(cw))
    out = ops["conv1d_update"](xin, pool, idx, cw)
    assert rel(out, ref) <= 1e-2 and rel(pool, ref_pool) <= 1e-2
    # attention inputs on the 9B shape: 16 query / 4 KV heads of 256, 64 rotary dims, page-major pool
    qkv, qw, kw = r(64, 2 * 16 * 256 + 2 * 4 * 256).bfloat16(), (r(256) * 0.1).bfloat16(), (r(256) * 0.1).bfloat16()
    angles = r(64, 32)
    cos, sin = torch.cat((angles, angles), -1).cos().bfloat16(), torch.cat((angles, angles), -1).sin().bfloat16()
    kv = r(40, 2, 2, 16, 4, 256).bfloat16()
    slots = torch.randperm(40 * 16, device=DEV)[:64]
    ref_kv = f64(kv)
    ref_q = torch_ref.attention_inputs(
        f64(qkv), 16, f64(qw), f64(kw), 1e-6, f64(cos), f64(sin), ref_kv[:, 1, 0], ref_kv[:, 1, 1], slots.cpu()
    )
    q = ops["attention_inputs"](qkv, 16, qw, kw, 1e-6, cos, sin, kv[:, 1, 0], kv[:, 1, 1], slots)
    assert rel(q, ref_q) <= 1e-2 and rel(kv, ref_kv) <= 1e-2
    gate = qkv[:, : 2 * 16 * 256].view(64, 16, 512)[..., 256:]
    assert rel(ops["sigmoid_gate"](q, gate), torch_ref.sigmoid_gate(f64(q), f64(gate))) <= 1e-2


@pytest.mark.parametrize("tokens", [1, 3, 4, 8, 16, 64, 300, 2048, 4096])
def test_triton_fused_moe_matches_reference(tokens):
    """The fused MoE layer against the torch reference (grouped GEMMs) on the Qwen3.5-35B-A3B expert shapes,
    bf16: decode batches (the pair-wise path up to DECODE_MAX_TOKENS, then most experts unused) up to a prefill
    chunk; the routed experts alone (a zero shared expert) and the whole layer."""
    moe = backend("triton")["moe"]
    g = torch.Generator(device=DEV).manual_seed(tokens)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV)  # noqa: E731
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    x = r(tokens, hidden).bfloat16()
    gates = r(tokens, experts + 1).bfloat16()  # router logits and the shared expert's gate, as one GEMM gives them
    logits, gate = gates[:, :experts], gates[:, experts:]
    w13 = (r(experts, 2 * inter, hidden) / hidden**0.5).bfloat16()
    w2 = (r(experts, hidden, inter) / inter**0.5).bfloat16()
    sw13, sw2 = (r(2 * inter, hidden) / hidden**0.5).bfloat16(), (r(hidden, inter) / inter**0.5).bfloat16()
    for norm in (True, False):
        for shared_down in (sw2, torch.zeros_like(sw2)):
            args = (x, logits, w13, w2, top_k, norm, sw13, shared_down, gate)
            assert rel(moe(*args), torch_ref.moe(*args)) < 1e-2

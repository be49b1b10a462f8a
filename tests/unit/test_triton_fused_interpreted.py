"""The fused Triton kernels (norms, silu-mul, conv1d decode step) run through Triton's CPU interpreter against
the torch reference expressions, in float32 and bfloat16, with strided views and sizes that are not a power
of two. Several checks share one subprocess to pay the interpreter's start-up once."""

import pytest
from test_triton_kernels_interpreted import check_interpreted

pytest.importorskip("triton")

# err(got, ref) -> (error, tolerance): max abs diff below 1e-5 for float32, max abs diff relative to max |ref|
# below 1e-2 for bfloat16; NaN or inf in `got` is an infinite error.
PRELUDE = """
    import json
    import numpy as np
    import torch
    import torch.nn.functional as F
    import triton.language as tl
    from triton.runtime import interpreter
    from deltamesh.kernels import torch_ref, triton_conv1d, triton_fused
    torch.manual_seed(0)
    errors = {}

    # The interpreter truncates float32 -> bfloat16, where GPUs (and torch) round to nearest even; round as
    # they do, so the bf16 checks measure the kernels and not the interpreter.
    interpreted_cast = interpreter.InterpreterBuilder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.asarray(src.data)).bfloat16().view(torch.uint16).numpy()
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return interpreted_cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_rne

    def err(got, ref):
        assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
        diff = float((got.float() - ref.float()).abs().max()) if torch.isfinite(got).all() else float("inf")
        if ref.dtype == torch.float32:
            return diff, 1e-5
        return diff / float(ref.float().abs().max()), 1e-2
"""


def check(body: str) -> None:
    check_interpreted(PRELUDE, body)


def test_norms_match_reference():
    check("""
    def rms_ref(x, w, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)

    def gated_ref(x, z, w, eps):
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (w * normed * F.silu(z.float())).to(x.dtype)

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 96, dtype=dtype) * 3
        w = torch.randn(96, dtype=dtype) * 0.1
        errors[f"rms_norm 2-D {dtype}"] = err(triton_fused.rms_norm(x, w, 1e-6), rms_ref(x, w, 1e-6))
        # q/k norm: per-head views of a fused projection, strided in the token and head dims.
        q, k = torch.randn(3, 2, 3, 64, dtype=dtype).unbind(1)
        qk_w = torch.randn(64, dtype=dtype) * 0.1
        for name, heads in (("q", q), ("k", k[:, 1:])):
            got = triton_fused.rms_norm(heads, qk_w, 1e-6)
            assert got.is_contiguous()
            errors[f"rms_norm 3-D strided {name} {dtype}"] = err(got, rms_ref(heads, qk_w, 1e-6))

        res = torch.randn(4, 80, dtype=dtype) * 2
        normed, new_res = triton_fused.add_rms_norm(x[:4, :80], res, w[:80], 1e-6)
        errors[f"add_rms_norm residual {dtype}"] = err(new_res, x[:4, :80] + res)
        errors[f"add_rms_norm normed {dtype}"] = err(normed, rms_ref(x[:4, :80] + res, w[:80], 1e-6))

        xz = torch.randn(6, 2 * 48, dtype=dtype) * 2
        gx, gz = xz.split(48, dim=-1)  # row-strided views, as split from a projection
        gw = torch.randn(48, dtype=dtype)
        errors[f"gated_rms_norm {dtype}"] = err(triton_fused.gated_rms_norm(gx, gz, gw, 1e-6),
                                                gated_ref(gx, gz, gw, 1e-6))
        # per head, as the GDN layer calls it: x [T, H, dim] contiguous, z a head view of the projection
        hx = torch.randn(3, 4, 48, dtype=dtype)
        hz = (torch.randn(3, 4 * 48 + 7, dtype=dtype) * 2)[:, 7:].view(3, 4, 48)
        errors[f"gated_rms_norm 3-D {dtype}"] = err(triton_fused.gated_rms_norm(hx, hz, gw, 1e-6),
                                                    gated_ref(hx, hz, gw, 1e-6))
    """)


def test_silu_mul_and_conv1d_update_match_reference():
    check("""
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = torch.randn(3, 2 * 1100, dtype=dtype) * 3  # I spans two blocks, the second partial
        gate, up = gate_up.chunk(2, dim=-1)
        errors[f"silu_mul {dtype}"] = err(triton_fused.silu_mul(gate_up), F.silu(gate) * up)

    channels, width = 300, 4  # channels span two blocks, the second partial
    for x_dtype, pool_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                (torch.bfloat16, torch.float32)):
        for idx_dtype, activation in ((torch.int32, "silu"), (torch.int64, None)):
            x = torch.randn(3, channels + 16, dtype=x_dtype)[:, 8:-8]  # a row-strided view
            weight = torch.randn(channels, width, dtype=x_dtype)
            pool = torch.randn(6, channels, width - 1, dtype=pool_dtype)
            idx = torch.tensor([4, 0, 2], dtype=idx_dtype)
            before, ref_pool = pool.clone(), pool.clone()
            ref = torch_ref.conv1d_update(x, ref_pool, idx, weight, activation)
            got = triton_conv1d.conv1d_update(x, pool, idx, weight, activation)
            case = f"conv1d_update x {x_dtype} pool {pool_dtype} {idx_dtype} {activation}"
            errors[case] = err(got, ref)
            # The indexed rows shift in place exactly as the reference's; the other rows stay untouched.
            assert torch.equal(pool, ref_pool) and not torch.equal(pool[idx.long()], before[idx.long()]), case
            assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]]), case
    """)


def test_conv1d_prefill_matches_reference():
    """Variable-length sequences (one shorter than the conv's history, one spanning three token tiles, one of
    exactly one tile) each continuing from its pooled state; the state rows are replaced as the reference's."""
    check("""
    channels, width, lens = 200, 4, [2, 150, 1, 64]
    cu = torch.tensor([0, 2, 152, 153, 217], dtype=torch.int32)
    for x_dtype, pool_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                (torch.bfloat16, torch.float32)):
        x = torch.randn(sum(lens), channels + 16, dtype=x_dtype)[:, 8:-8]  # a row-strided view
        weight = torch.randn(channels, width, dtype=x_dtype)
        pool = torch.randn(7, channels, width - 1, dtype=pool_dtype)
        idx = torch.tensor([5, 0, 3, 6], dtype=torch.int32)
        before, ref_pool = pool.clone(), pool.clone()
        ref = torch_ref.conv1d_prefill(x, lens, None, ref_pool, idx, weight, "silu")
        got = triton_conv1d.conv1d_prefill(x, lens, cu, pool, idx, weight, "silu")
        case = f"conv1d_prefill x {x_dtype} pool {pool_dtype}"
        errors[case] = err(got, ref)
        errors[case + " state"] = err(pool, ref_pool)
        assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]]), case
    """)


def test_attention_inputs_and_gate_match_reference():
    check("""
    t, heads, kv_heads, dim, rot, page = 5, 4, 2, 32, 8, 16
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(t, 2 * heads * dim + 2 * kv_heads * dim + 8, dtype=dtype)[:, 8:] * 3  # a strided view
        qw, kw = torch.randn(dim, dtype=dtype) * 0.1, torch.randn(dim, dtype=dtype) * 0.1
        angles = torch.randn(t, rot // 2)
        cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
        pool = torch.randn(6, 3, 2, page, kv_heads, dim, dtype=dtype)  # [pages, layers, k|v, page, heads, dim]
        ref_pool = pool.clone()
        slots = torch.tensor([17, 3, 90, 40, 41])  # pages 1, 0, 5, 2, 2
        got = triton_fused.attention_inputs(qkv, heads, qw, kw, 1e-6, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots)
        ref = torch_ref.attention_inputs(qkv, heads, qw, kw, 1e-6, cos, sin, ref_pool[:, 1, 0], ref_pool[:, 1, 1],
                                         slots)
        errors[f"attention_inputs q {dtype}"] = err(got, ref)
        errors[f"attention_inputs kv cache {dtype}"] = err(pool, ref_pool)
        assert torch.equal(pool[:, [0, 2]], ref_pool[:, [0, 2]])  # other layers untouched

        x = torch.randn(t, heads, dim, dtype=dtype)
        gate = qkv[:, : 2 * heads * dim].view(t, heads, 2 * dim)[..., dim:]
        errors[f"sigmoid_gate {dtype}"] = err(triton_fused.sigmoid_gate(x, gate), torch_ref.sigmoid_gate(x, gate))
    """)


@pytest.mark.slow
def test_fused_moe_matches_reference():
    """Both fused MoE paths against the torch reference: the pair-wise path of few tokens (decode; a shared
    expert narrower or wider than the routed ones) and the aligned path (most experts unused and partly filled
    blocks; the larger blocks of many pairs, several to an expert), top-k renormalised or not, an expert count
    that is not a power of two; each also as an expert-parallel rank holding three of the experts. float32 only:
    the interpreter's dots read bfloat16 operands as raw integers; the bfloat16 kernels are checked on the GPU
    (tests/gpu)."""
    check("""
    from deltamesh.kernels import triton_moe, triton_moe_aligned
    # The last case runs the blocks gemm_config gives more than 2048 pairs (64 rows) on 640 pairs, about 80 to
    # an expert, so most experts fill one block and start another: the interpreter's time grows with the tokens
    # (one program each for routing and combining), and 2400 pairs cost it four times as long for no other path.
    cases = ((1, 10, 2, True, 48, None), (5, 12, 3, False, 80, None), (4, 10, 2, True, 32, None),
             (3, 10, 2, True, 48, triton_moe_aligned.GemmConfig(16, 64, 128)), (70, 12, 4, False, 64, None),
             (160, 8, 4, True, 48, triton_moe_aligned.gemm_config(2400)))
    for tokens, experts, top_k, norm, shared_inter, config in cases:
        hidden, inter = 96, 48
        x = torch.randn(tokens, hidden)
        w13 = torch.randn(experts, 2 * inter, hidden) / hidden**0.5
        w2 = torch.randn(experts, hidden, inter) / inter**0.5
        sw13 = torch.randn(2 * shared_inter, hidden) / hidden**0.5
        sw2 = torch.randn(hidden, shared_inter) / shared_inter**0.5
        # the router's logits and the shared expert's gate come from one GEMM: row-strided views of it
        gates = torch.randn(tokens, experts + 1)
        logits, gate = gates[:, :experts], gates[:, experts:]
        ref = torch_ref.moe(x, logits, w13, w2, top_k, norm, sw13, sw2, gate)
        got = triton_moe.moe(x, logits, w13, w2, top_k, norm, sw13, sw2, gate, config=config)
        path = "aligned" if config or tokens > triton_moe.DECODE_MAX_TOKENS else "pairs"
        errors[f"{path} T={tokens} E={experts} k={top_k} shared={shared_inter}"] = (float((got - ref).abs().max()), 1e-4)
        # expert parallel: a rank holding experts [2, 5) adds only the pairs routed to them
        part = (slice(2, 5),)
        ref = torch_ref.moe(x, logits, w13[part], w2[part], top_k, norm, sw13, sw2, gate, first_expert=2)
        got = triton_moe.moe(x, logits, w13[part], w2[part], top_k, norm, sw13, sw2, gate, first_expert=2, config=config)
        errors[f"{path} T={tokens} experts 2..4 of {experts}"] = (float((got - ref).abs().max()), 1e-4)
    """)

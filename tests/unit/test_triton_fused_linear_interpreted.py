"""The GEMV with its prologues (triton_gemv.py, through the fused ops of triton_fused_linear.py) and with plain rows
beside an FP8 weight (triton_linear.linear on a list of weights) run through Triton's CPU interpreter: against the
torch reference in float32 (plain weights exactly, FP8 weights against the arithmetic kernels/fp8.py spells out),
and in bfloat16 against the unfused Triton kernels they replace (the op's own kernel, then the projection)."""

import pytest
from test_triton_kernels_interpreted import check_interpreted

pytest.importorskip("triton")

PRELUDE = """
    import json
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter
    from deltamesh.kernels import torch_ref, triton_fused, triton_fused_linear, triton_gemv, triton_linear
    from deltamesh.kernels.fp8 import Fp8Weight, quantize_blocks, reference_linear
    torch.manual_seed(0)
    errors = {}

    # The interpreter truncates float32 -> bfloat16 and rounds float32 -> e4m3 its own way; GPUs (and torch)
    # round to nearest even: round as they do, so the checks measure the kernels and not the interpreter.
    interpreted_cast = interpreter.InterpreterBuilder.cast_impl
    interpreted_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.asarray(src.data)).bfloat16().view(torch.uint16).numpy()
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return interpreted_cast(self, src, dst_type)

    def to_e4m3_rne(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            q = torch.from_numpy(np.asarray(src.data)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(q, tl.float8e4nv)
        return interpreted_fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.cast_impl = cast_rne
    interpreter.InterpreterBuilder.create_fp_to_fp = to_e4m3_rne

    def rel(got, ref):
        assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
        if not torch.isfinite(got).all():
            return float("inf")
        return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())

    def fp8(*shape):
        return Fp8Weight(*quantize_blocks(torch.randn(*shape) / shape[-1] ** 0.5))

    # K (512) in one slice, in two, and in four of 256 (two of them empty): the last slice to arrive adds them up
    TILES = [None, triton_gemv.GemvConfig(8, 256, 2, 4), triton_gemv.GemvConfig(16, 256, 4, 4)]

    def heads(t, h, d, dtype):
        # x contiguous [T, H, D]; the second operand a strided view into a wider projection, as the model passes
        other = torch.randn(t, h, 3 * d, dtype=dtype)[..., d : 2 * d]
        return torch.randn(t, h, d, dtype=dtype) * 2, other
"""


def check(body: str) -> None:
    check_interpreted(PRELUDE, body)


def test_prologues_match_the_ops_they_replace():
    """The three fused ops at one token, plain float32 weights (exact up to summation order), FP8 weights (the
    FP8 arithmetic on the reference op's output), and bfloat16 against the unfused Triton kernels; a bias on
    the gate; the split-K counters back at 0 for the next call."""
    check("""
    gemv = triton_gemv.gemv
    Prologue = triton_gemv.Prologue
    for dtype, weights, tiles in ((torch.float32, "plain", TILES), (torch.float32, "fp8", TILES[1:2]),
                                  (torch.bfloat16, "plain", TILES[2:])):
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for tile in tiles:
            case = f"{dtype} {weights} {tile}"
            w = fp8(40, 512) if weights == "fp8" else (torch.randn(40, 512) / 512**0.5).to(dtype)
            project = (lambda a: reference_linear(a, w)) if weights == "fp8" else (lambda a: torch_ref.linear(a, w))
            bias = torch.randn(40, dtype=dtype)
            x, gate = heads(1, 4, 128, dtype)
            got = gemv(x, w, bias, tile, prologue=Prologue(triton_gemv.SIGMOID_GATE, gate))
            if dtype == torch.float32:
                ref = project(torch_ref.sigmoid_gate(x, gate)) + bias
            else:
                ref = gemv(triton_fused.sigmoid_gate(x, gate), w, bias, tile)
            errors[f"sigmoid gate {case}"] = (rel(got, ref), tol)

            x, z = heads(1, 4, 128, dtype)
            norm_w = torch.rand(128, dtype=dtype) + 0.5
            got = gemv(x, w, None, tile, prologue=Prologue(triton_gemv.GATED_NORM, z, norm_w, 1e-6))
            if dtype == torch.float32:
                ref = project(torch_ref.gated_rms_norm(x, z, norm_w, 1e-6).reshape(1, -1))
            else:
                ref = gemv(triton_fused.gated_rms_norm(x, z, norm_w, 1e-6).reshape(1, -1), w, None, tile)
            errors[f"gated norm {case}"] = (rel(got, ref), tol)
            # the norm's weight in float32 beside bf16 heads (the product is then not rounded)
            got = gemv(x, w, None, tile, prologue=Prologue(triton_gemv.GATED_NORM, z, norm_w.float(), 1e-6))
            ref = torch_ref.gated_rms_norm(x, z, norm_w.float(), 1e-6).reshape(1, -1)
            ref = gemv(ref, w, None, tile) if dtype == torch.bfloat16 else project(ref)
            errors[f"gated norm, float32 weight {case}"] = (rel(got, ref), tol)

            h, res = torch.randn(1, 512, dtype=dtype) * 3, torch.randn(1, 512, dtype=dtype)
            norm_w = torch.randn(512, dtype=dtype) * 0.1
            normed, total = torch.empty_like(h), torch.empty_like(h)
            got = gemv(h, w, None, tile, prologue=Prologue(triton_gemv.ADD_NORM, res, norm_w, 1e-6, normed, total))
            ref_normed, ref_total = torch_ref.add_rms_norm(h, res, norm_w, 1e-6)
            errors[f"add norm: residual {case}"] = (rel(total, ref_total), tol)
            errors[f"add norm: normed {case}"] = (rel(normed, ref_normed), tol)
            ref = project(ref_normed) if dtype == torch.float32 else gemv(ref_normed, w, None, tile)
            errors[f"add norm: projection {case}"] = (rel(got, ref), tol)
    assert int(triton_gemv._arrivals(torch.device("cpu")).abs().sum()) == 0
    """)


def test_fused_ops_fall_back_past_one_token_and_take_the_model_shapes():
    """The registry's ops: fused at one token, the op's kernel then the projection above (both against the torch
    reference); a wide plain weight stays on the projection alone; a list of weights (an FP8 weight and plain rows
    beside it) in one launch at one token, one projection each above, never a copy of the plain rows."""
    check("""
    fl = triton_fused_linear
    for tokens in (1, 3):
        w = torch.randn(160, 256) / 16
        x, gate = heads(tokens, 2, 128, torch.float32)
        errors[f"gate_linear T={tokens}"] = (rel(fl.gate_linear(x, gate, w), torch_ref.gate_linear(x, gate, w)), 1e-5)
        x, z = heads(tokens, 2, 128, torch.float32)
        norm_w = torch.rand(128) + 0.5
        got, ref = fl.gated_norm_linear(x, z, norm_w, 1e-6, w), torch_ref.gated_norm_linear(x, z, norm_w, 1e-6, w)
        errors[f"gated_norm_linear T={tokens}"] = (rel(got, ref), 1e-5)
        h, res, norm_w = torch.randn(tokens, 256), torch.randn(tokens, 256), torch.randn(256) * 0.1
        for wide in (False, True):
            weight = torch.randn(fl.PLAIN_MAX_ROWS + 1, 256) / 16 if wide else w
            got = fl.add_rms_norm_linear(h, res, norm_w, 1e-6, weight)
            ref = torch_ref.add_rms_norm_linear(h, res, norm_w, 1e-6, weight)
            for name, g, r in zip(("normed", "residual", "projection"), got, ref):
                errors[f"add_rms_norm_linear {name} T={tokens} wide={wide}"] = (rel(g, r), 1e-5)

        qkvz, ba = fp8(384, 512), torch.randn(40, 512) / 512**0.5
        x = torch.randn(tokens, 512)
        got = triton_linear.linear(x, [qkvz, ba])
        assert [tuple(g.shape) for g in got] == [(tokens, 384), (tokens, 40)]
        if tokens == 1:  # one launch: views of one output
            assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
        errors[f"fp8 rows T={tokens}"] = (rel(got[0], reference_linear(x, qkvz)), 1e-5)
        errors[f"plain rows beside T={tokens}"] = (rel(got[1], x @ ba.T), 1e-5)
    x = torch.randn(1, 512)
    for tile in TILES:  # the tail's blocks of rows after the FP8 weight's, K split or not
        out = triton_gemv.gemv(x, qkvz, None, tile, tail=ba)
        errors[f"tail {tile}"] = (rel(out, torch.cat([reference_linear(x, qkvz), x @ ba.T], -1)), 1e-5)
    """)


def test_a_small_weight_runs_the_gemv_at_a_few_tokens_and_a_large_one_does_not():
    """triton_gemv.small_weight_gemv: a router-sized weight at 2-4 tokens (a verify step's rows) takes the GEMV, with
    the fused op's prologue, instead of the op's own kernel then cuBLAS; 5 tokens, a weight over SMALL_WEIGHT_BYTES
    or the switch at 0 do not. Each result against the torch reference."""
    check("""
    fl, tg = triton_fused_linear, triton_gemv
    calls = []
    unfused_norm, gemv = triton_fused.add_rms_norm, triton_linear.gemv
    triton_fused.add_rms_norm = lambda *a: calls.append("norm kernel") or unfused_norm(*a)
    triton_linear.gemv = lambda *a, **k: calls.append("gemv") or gemv(*a, **k)
    small = torch.randn(257, 256) / 16
    large = torch.randn(tg.SMALL_WEIGHT_BYTES // (4 * 1024) + 16, 1024) / 32  # float32 rows of 1024: over the bytes
    small_fp8 = fp8(256, 512)
    for tokens, on, w, want in (
        (3, 4, small, []),  # fused: the prologue in the GEMV, no norm kernel
        (5, 4, small, ["norm kernel"]),
        (3, 4, large, ["norm kernel"]),
        (3, 0, small, ["norm kernel"]),
    ):
        tg.SMALL_WEIGHT_MAX_TOKENS, calls[:] = on, []
        k = w.shape[1]
        h, res, norm_w = torch.randn(tokens, k), torch.randn(tokens, k), torch.randn(k) * 0.1
        got = fl.add_rms_norm_linear(h, res, norm_w, 1e-6, w)
        ref = torch_ref.add_rms_norm_linear(h, res, norm_w, 1e-6, w)
        assert calls == want, (tokens, on, w.shape, calls)
        errors[f"add_rms_norm_linear T={tokens} on={on} rows={w.shape[0]}"] = (rel(got[2], ref[2]), 1e-5)
    for tokens, on, want in ((1, 4, []), (3, 4, ["gemv"]), (5, 4, []), (3, 0, [])):  # plain: cuBLAS at one token
        tg.SMALL_WEIGHT_MAX_TOKENS, calls[:] = on, []
        x = torch.randn(tokens, 256)
        got = triton_linear.linear(x, small)
        assert calls == want, (tokens, on, calls)
        errors[f"plain linear T={tokens} on={on}"] = (rel(got, x @ small.T), 1e-5)
    # layouts the GEMV does not take stay on F.linear: a transposed weight, 3-D x
    tg.SMALL_WEIGHT_MAX_TOKENS, calls[:] = 4, []
    x, transposed = torch.randn(3, 256), (torch.randn(256, 257) / 16).t()
    errors["plain linear, transposed weight"] = (rel(triton_linear.linear(x, transposed), x @ transposed.T), 1e-5)
    x3 = torch.randn(3, 2, 256)
    errors["plain linear, 3-D x"] = (rel(triton_linear.linear(x3, small), x3 @ small.T), 1e-5)
    assert calls == [], calls
    for tokens, on, want in ((3, 4, ["gemv"]), (5, 4, []), (3, 0, [])):  # FP8: past one token cuBLAS's FP8 GEMM
        tg.SMALL_WEIGHT_MAX_TOKENS, calls[:] = on, []
        x = torch.randn(tokens, 512)
        got = triton_linear.linear(x, small_fp8)
        assert calls == want, (tokens, on, calls)
        errors[f"fp8 linear T={tokens} on={on}"] = (rel(got, reference_linear(x, small_fp8)), 1e-5)
    """)

"""The FP8 Triton kernels (the GEMV and the activation quantization of linear layers, both fused MoE paths) run through Triton's CPU
interpreter against the arithmetic kernels/fp8.py spells out in torch, so CI checks their indexing, masks and
scales without a GPU. float32 activations: the interpreter's dots read bfloat16 operands as raw integers
(tests/gpu checks bf16)."""

import pytest
from test_triton_kernels_interpreted import check_interpreted

pytest.importorskip("triton")

PRELUDE = """
    import json
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter
    from deltamesh.kernels import torch_ref, triton_gemv, triton_linear, triton_moe, triton_moe_aligned, triton_moe_pairs
    from deltamesh.kernels.fp8 import Fp8Weight, dequantize, quantize_blocks, reference_linear, reference_moe
    torch.manual_seed(0)
    errors = {}

    # The interpreter rounds float32 -> e4m3 its own way; GPUs (and torch) round to nearest even.
    interpreted_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def to_e4m3_rne(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            q = torch.from_numpy(np.asarray(src.data)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(q, tl.float8e4nv)
        return interpreted_fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.create_fp_to_fp = to_e4m3_rne

    def fp8(*shape):
        return Fp8Weight(*quantize_blocks(torch.randn(*shape) / shape[-1] ** 0.5))

    def rel(got, ref):
        return float((got - ref).abs().max() / ref.abs().max())
"""


def check(body: str) -> None:
    check_interpreted(PRELUDE, body)


@pytest.mark.slow
def test_fp8_gemv_and_activation_quantization_match_their_arithmetic():
    """A last block of rows and a last group of columns cut short, a bias, FP8 and plain weights; the activation
    quantization cuBLAS's FP8 GEMM takes (which needs a GPU) against fp8.quantize_activations."""
    check("""
    from deltamesh.kernels.fp8 import quantize_activations
    for tokens in (1, 3, 9):
        w, bias = fp8(68, 1100), torch.randn(68)  # the last block of 8 and of 16 rows cut short
        x = torch.randn(tokens, 1100) * torch.logspace(-2, 1, 1100)  # groups of very different magnitudes
        tiles = [triton_gemv.gemv_config(tokens, 68, 1100, x.device)]
        if tokens <= 3:  # K in 1, 2 and 4 slices of whole BLOCK_Ks, the last short
            tiles += [triton_gemv.GemvConfig(8, 256, 1, 2), triton_gemv.GemvConfig(16, 512, 2, 4),
                      triton_gemv.GemvConfig(8, 256, 4, 4)]
        for tile in tiles:
            got = triton_gemv.gemv(x, w, bias, tile)
            errors[f"gemv T={tokens} {tile}"] = (rel(got, reference_linear(x, w, bias)), 1e-5)
            errors[f"gemv T={tokens} {tile} vs unquantized"] = (rel(got, x @ dequantize(w).T + bias), 0.1)
        plain = dequantize(w)
        for tile in tiles[-2:]:
            errors[f"gemv T={tokens} plain {tile}"] = (rel(triton_gemv.gemv(x, plain, bias, tile), x @ plain.T + bias), 1e-5)
        errors[f"linear T={tokens} plain"] = (rel(triton_linear.linear(x, plain), x @ plain.T), 1e-5)
    arrivals = triton_gemv._arrivals(torch.device("cpu"))
    assert int(arrivals.abs().sum()) == 0, "every split-K counter is back at 0 for the next call"
    assert triton_gemv.gemv_config(1, 200, 1100, torch.device("cpu")).split_k == 1  # blocks of rows enough to fill the SMs
    assert triton_gemv.gemv_config(1, 16, 8192, torch.device("cpu")).split_k == 8  # narrow: split to fill SMs
    assert triton_gemv.gemv(torch.randn(0, 1100), w).shape == (0, 68)  # a data-parallel rank's empty step
    x = torch.randn(5, 300) * torch.logspace(-2, 1, 300)
    q, scales = triton_linear.quantize_activations(x)
    q_ref, scales_ref = quantize_activations(x)
    assert scales.stride() == (1, 5)  # token-fastest, as cuBLAS reads them
    errors["quantized values"] = (float((q.float() - q_ref.float()).abs().max()), 1e-9)
    errors["activation scales"] = (rel(scales, scales_ref), 1e-6)
    q, scales = triton_linear.quantize_activations(x, 16)  # padded to the rows cuBLAS takes
    assert scales.shape == (16, 3) and scales.stride() == (1, 16)
    errors["padding rows are zeros"] = (float(q[5:].float().abs().max()), 1e-9)
    errors["padded values"] = (float((q[:5].float() - q_ref.float()).abs().max()), 1e-9)
    """)


@pytest.mark.slow
def test_fp8_moe_matches_its_arithmetic():
    """Both paths, against the same routing with every expert computed by reference_linear (activations
    quantized before gate/up and before down) and against the dequantized experts without that quantization."""
    check("""
    from deltamesh.kernels.triton_moe_pairs import PairConfig, PairTile
    hidden, inter = 256, 128
    # pairs at one token with its default tiles; at three with wider ones than the default (the same code, an
    # eighth of the programs for the interpreter); the aligned path's blocks (16 rows, FP8 forces the rest) one to
    # an expert, then 18 pairs to each of 4 experts (a second, partly filled block). On the CPU the aligned path's
    # shared expert runs through the GEMV at every token (most of this test's time): kept narrow there, a width
    # other than the experts' and less than one scale group
    wide = PairConfig(PairTile(32, 512, 1), PairTile(32, 512, 1))
    for tokens, experts, top_k, norm, shared_inter, config in (
            (1, 6, 2, True, 128, None), (3, 6, 2, False, 256, wide),
            (8, 6, 2, True, 128, triton_moe_aligned.GemmConfig(16, 64, 128)), (24, 4, 3, True, 64, None)):
        w13, w2 = fp8(experts, 2 * inter, hidden), fp8(experts, hidden, inter)
        sw13, sw2 = fp8(2 * shared_inter, hidden), fp8(hidden, shared_inter)
        x = torch.randn(tokens, hidden)
        gates = torch.randn(tokens, experts + 1)
        logits, gate = gates[:, :experts], gates[:, experts:]
        if isinstance(config, PairConfig):
            got = triton_moe_pairs.moe_pairs(x, logits, w13, w2, top_k, norm, sw13, sw2, gate, tiles=config)
        else:
            got = triton_moe.moe(x, logits, w13, w2, top_k, norm, sw13, sw2, gate, config=config)
        path = "aligned" if tokens > triton_moe.DECODE_MAX_TOKENS else "pairs"
        case = f"{path} T={tokens} k={top_k} shared={shared_inter}"
        errors[case] = (rel(got, reference_moe(x, logits, w13, w2, top_k, norm, sw13, sw2, gate)), 1e-3)
        unquantized = torch_ref.moe(x, logits, w13, w2, top_k, norm, sw13, sw2, gate)
        errors[case + " vs unquantized"] = (rel(got, unquantized), 0.1)
    """)

"""FP8 weights on the GPU: the Triton kernels against the arithmetic kernels/fp8.py spells out in torch (tight)
and against the dequantized weights without activation quantization (FP8's own tolerance), on the real
Qwen3.5-35B-A3B shapes; then a whole engine with an FP8 checkpoint against the same checkpoint dequantized."""

import pytest
import torch

from deltamesh.kernels import torch_ref, triton_gemv, triton_linear, triton_moe
from deltamesh.kernels.fp8 import Fp8Weight, dequantize, quantize_blocks, reference_linear, reference_moe

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "NaN/inf"
    return ((out - ref).norm() / ref.norm()).item()


def fp8_weight(g, *shape) -> Fp8Weight:
    return Fp8Weight(*quantize_blocks(torch.randn(*shape, generator=g, device=DEV) / shape[-1] ** 0.5))


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 16, 300, 4096])
def test_fp8_linear_matches_its_arithmetic(tokens):
    """The 35B-A3B model's projections (GDN in_proj, attention o_proj: cuBLAS's FP8 GEMM past GEMV_MAX_TOKENS) and
    one with a bias and cut-short edges (the GEMV at every size); every GEMV tile of the sweep's grid."""
    g = torch.Generator(device=DEV).manual_seed(tokens)
    for n, k, with_bias in ((12288, 2048, False), (2048, 4096, False), (320, 300, True)):
        w = fp8_weight(g, n, k)
        x = torch.randn(tokens, k, generator=g, device=DEV).bfloat16()
        bias = torch.randn(n, generator=g, device=DEV).bfloat16() if with_bias else None
        ref = reference_linear(x, w, bias)
        assert rel(triton_linear.linear(x, w, bias), ref) < 1e-2, (n, k)
        if tokens <= 4:
            # (a split call has one arrival counter per token and block of rows: gemv_config stays within them)
            for tile in [
                triton_gemv.GemvConfig(bn, bk, split, 4)
                for bn in (4, 8, 16, 32)
                for bk in (256, 512)
                for split in (1, 4)
                if split == 1 or -(-n // bn) * tokens <= triton_gemv.ARRIVAL_COUNTERS
            ]:
                assert rel(triton_gemv.gemv(x, w, bias, tile), ref) < 1e-2, (n, k, tile)
        unquantized = x.float() @ dequantize(w).T + (bias.float() if with_bias else 0)
        assert rel(triton_linear.linear(x, w, bias), unquantized) < 0.1


def test_split_k_gemv_repeats_exactly_under_graph_replay():
    """One token through the 35B-A3B projections' FP8 GEMV (narrow layers split K): captured in a CUDA graph and
    replayed, the same bits every time (the slices' sums are added in slice order, and each call leaves its
    counters at 0 for the next)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    for n, k in ((12352, 2048), (2048, 4096), (257, 2048)):
        w = fp8_weight(g, n, k)
        x = torch.randn(1, k, generator=g, device=DEV).bfloat16()
        assert n > 4000 or triton_gemv.gemv_config(1, n, k, DEV).split_k > 1, "a narrow layer splits K"
        out = torch.empty(1, n, dtype=torch.bfloat16, device=DEV)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out.copy_(triton_linear.linear(x, w))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out.copy_(triton_linear.linear(x, w))
        torch.cuda.current_stream().wait_stream(stream)
        first = out.clone()
        for _ in range(20):
            graph.replay()
            assert torch.equal(out, first), (n, k)
        assert rel(first, reference_linear(x, w)) < 1e-2


@pytest.mark.parametrize("tokens", [1, 3, 4, 8, 64, 300])
def test_fp8_moe_matches_its_arithmetic(tokens):
    g = torch.Generator(device=DEV).manual_seed(tokens)
    hidden, inter, experts, top_k = 2048, 512, 256, 8
    w13, w2 = fp8_weight(g, experts, 2 * inter, hidden), fp8_weight(g, experts, hidden, inter)
    sw13, sw2 = fp8_weight(g, 2 * inter, hidden), fp8_weight(g, hidden, inter)
    x = torch.randn(tokens, hidden, generator=g, device=DEV).bfloat16()
    gates = torch.randn(tokens, experts + 1, generator=g, device=DEV).bfloat16()
    logits, gate = gates[:, :experts], gates[:, experts:]
    for norm in (True, False):
        args = (x, logits, w13, w2, top_k, norm, sw13, sw2, gate)
        got = triton_moe.moe(*args)
        # the reference rounds its own SwiGLU output to bf16 before quantizing it: a few values land one e4m3
        # step apart from the kernel's
        assert rel(got, reference_moe(*args)) < 3e-2
        assert rel(got, torch_ref.moe(*args)) < 0.1


def test_an_fp8_checkpoint_serves_close_to_its_dequantized_model(tmp_path):
    from fidelity.test_transformers_fidelity import engine_logits, prompt
    from hf_checkpoints import write_checkpoint

    from deltamesh.engine import Engine, EngineConfig, SamplingParams
    from deltamesh.engine.core import EngineCore
    from scripts.write_fp8_checkpoint import write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(write_checkpoint("qwen3_5_moe_fp8_shapes", tmp_path / "bf16", seed=4), tmp_path / "fp8")
    config = dict(model=str(fp8), device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=4)
    kept, dequantized = EngineCore(EngineConfig(**config)), EngineCore(EngineConfig(**config, quantization="none"))
    assert kept.model.layers[1].mlp.w13.dtype == torch.float8_e4m3fn and kept.kernels.chosen["moe"] == "triton"
    ids = prompt(128, seed=1)
    a, b = engine_logits(kept, ids, [96, 32]).float(), engine_logits(dequantized, ids, [96, 32]).float()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    print(f"FP8 against dequantized: logits {rel(a, b):.4f} apart, argmax agrees at {agree:.3f} of positions")
    # activations quantized at every projection of a small random model with a wide spread of weights: its
    # near-tied logits make the agreement noisy (0.79-0.85 over 48 positions with the same arithmetic summed in
    # different orders), hence 128 positions and a bound below that
    assert rel(a, b) < 0.3 and agree >= 0.75
    ids = ids[:48]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    firsts = []
    for quantization in ("auto", "none"):  # decode steps from CUDA graphs
        with Engine(EngineConfig(**config, quantization=quantization)) as eng:
            tokens = eng.generate(ids, params)[0].token_ids
            assert len(tokens) == 16
            firsts.append(tokens[0])
    assert firsts[0] == firsts[1]

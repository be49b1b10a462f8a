"""Projections fused with the op before them (kernels/triton_fused_linear.py) and FP8 weights with plain rows beside
them in one launch, on the GPU at the 35B-A3B shapes: against the float64 torch reference within bf16 tolerance
(FP8 weights: against the FP8 arithmetic on the reference op's output), then a whole model's logits and greedy
tokens with the fusion on and off. Skipped without CUDA."""

import pytest
import torch

from deltamesh.kernels import torch_ref, triton_fused_linear, triton_linear
from deltamesh.kernels.fp8 import Fp8Weight, dequantize, quantize_blocks, reference_linear

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "NaN/inf"
    return ((out - ref).norm() / ref.norm()).item()


def f64(t):
    return t.double().cpu()


def weight(n, k, fp8, g):
    w = torch.randn(n, k, generator=g, device=DEV) / k**0.5
    return Fp8Weight(*quantize_blocks(w)) if fp8 else w.bfloat16()


def project_reference(a, w):
    """The projection of a float64 reference input as the kernels compute it: FP8 arithmetic (quantized
    activations) for an Fp8Weight, exact otherwise."""
    if isinstance(w, Fp8Weight):
        return reference_linear(a.float().to(DEV), w).double().cpu()
    return a @ f64(w).T


def heads(t, h, d, g):
    x = torch.randn(t, h, d, generator=g, device=DEV).bfloat16()
    wide = torch.randn(t, h, 2 * d, generator=g, device=DEV).bfloat16()
    return x, wide[..., d:]  # the gate and z are views into a wider projection, as the model passes them


@pytest.fixture(params=[1, 3], ids=["fused", "unfused"])
def tokens(request):
    return request.param


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_ops_match_the_reference(tokens, fp8):
    """The attention's gate + o_proj (16 heads of 256), GDN's gated norm + out_proj (32 heads of 128), the
    post-attention norm + router and shared gate (257 rows) or a gate|up (1024 rows); 3 tokens take the unfused
    kernels."""
    fl, g = triton_fused_linear, torch.Generator(device=DEV).manual_seed(0)
    # FP8: the kernel quantizes its own (fp32/bf16) op output, the reference the float64 one; values near an e4m3
    # rounding boundary land a whole step (2**-3 relative) apart, fused or not.
    tol = 2e-2 if fp8 else 1e-2
    o_proj = weight(2048, 4096, fp8, g)
    x, gate = heads(tokens, 16, 256, g)
    bias = torch.randn(2048, generator=g, device=DEV).bfloat16()
    got = fl.gate_linear(x, gate, o_proj, None if fp8 else bias)
    ref = project_reference(torch_ref.sigmoid_gate(f64(x), f64(gate)), o_proj) + (0 if fp8 else f64(bias))
    assert rel(got, ref) <= tol

    x, z = heads(tokens, 32, 128, g)
    norm_w = torch.rand(128, generator=g, device=DEV).bfloat16() + 0.5
    got = fl.gated_norm_linear(x, z, norm_w, 1e-6, o_proj)
    ref = torch_ref.gated_rms_norm(f64(x), f64(z), f64(norm_w), 1e-6).reshape(tokens, -1)
    assert rel(got, project_reference(ref, o_proj)) <= tol

    h = torch.randn(tokens, 2048, generator=g, device=DEV).bfloat16() * 4
    res = torch.randn(tokens, 2048, generator=g, device=DEV).bfloat16()
    norm_w = (torch.randn(2048, generator=g, device=DEV) * 0.1).bfloat16()
    for rows in (257, 1024):
        w = weight(rows, 2048, fp8 and rows % 128 == 0, g)
        normed, total, got = fl.add_rms_norm_linear(h, res, norm_w, 1e-6, w)
        ref_normed, ref_total = torch_ref.add_rms_norm(f64(h), f64(res), f64(norm_w), 1e-6)
        assert rel(total, ref_total) <= 1e-2 and rel(normed, ref_normed) <= 1e-2
        assert rel(got, project_reference(ref_normed, w)) <= tol, rows


def test_fp8_projection_and_plain_rows_beside_it(tokens):
    """GDN's FP8 qkv|z (12288 rows) and its bf16 b|a (64 rows) of one input: one launch at one token."""
    g = torch.Generator(device=DEV).manual_seed(1)
    qkvz, ba = weight(12288, 2048, True, g), weight(64, 2048, False, g)
    x = torch.randn(tokens, 2048, generator=g, device=DEV).bfloat16()
    got_qkvz, got_ba = triton_linear.linear(x, [qkvz, ba])
    assert rel(got_qkvz, reference_linear(x.float(), qkvz)) <= 1e-2
    assert rel(got_qkvz, f64(x) @ f64(dequantize(qkvz)).T) <= 0.1
    assert rel(got_ba, f64(x) @ f64(ba).T) <= 1e-2


def test_fused_ops_repeat_exactly_under_graph_replay():
    """Each fused op at one token (K split over programs), captured in a CUDA graph and replayed: the same bits
    every time, as eager (the split-K counters left at 0 by each call)."""
    fl, g = triton_fused_linear, torch.Generator(device=DEV).manual_seed(2)
    o_proj, router = weight(2048, 4096, False, g), weight(257, 2048, False, g)
    x, gate = heads(1, 16, 256, g)
    core, z = heads(1, 32, 128, g)
    norm_w = torch.rand(128, generator=g, device=DEV).bfloat16()
    h, res = (torch.randn(1, 2048, generator=g, device=DEV).bfloat16() for _ in range(2))
    post_w = torch.zeros(2048, device=DEV).bfloat16()

    def step():
        return (
            fl.gate_linear(x, gate, o_proj),
            fl.gated_norm_linear(core, z, norm_w, 1e-6, o_proj),
            *fl.add_rms_norm_linear(h, res, post_w, 1e-6, router),
        )

    eager = [t.clone() for t in step()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager))


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_a_model_with_fused_projections_matches_it_unfused(tmp_path, quantization):
    """One-token steps (eager) and greedy decoding from CUDA graphs, each with the fusion on and off: logits
    within bf16 (FP8: activation quantization) summation-order noise; the decoded steps' best logprobs alike."""
    from fidelity.test_transformers_fidelity import engine_logits, prompt
    from hf_checkpoints import write_checkpoint

    from deltamesh.engine import Engine, EngineConfig, SamplingParams
    from deltamesh.engine.core import EngineCore

    model = write_checkpoint("qwen3_5_moe_fp8_shapes", tmp_path / "bf16", seed=4)
    config = dict(model=str(model), device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=4)
    config["max_num_batched_tokens"] = 64  # few piecewise graphs to capture
    config["quantization"] = quantization
    ids = prompt(40, seed=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    default = triton_fused_linear.FUSED_MAX_TOKENS
    logits, outputs = [], []
    try:
        for fused in (default, 0):
            triton_fused_linear.FUSED_MAX_TOKENS = fused
            with torch.inference_mode():
                logits.append(engine_logits(EngineCore(EngineConfig(**config)), ids, [32] + [1] * 8).float())
            with Engine(EngineConfig(**config)) as eng:  # decode graphs captured with this setting
                outputs.append(eng.generate(ids, params)[0])
    finally:
        triton_fused_linear.FUSED_MAX_TOKENS = default
    on, off = logits
    noise = 2e-2 if quantization == "none" else 0.1
    assert rel(on, off) <= noise
    assert (on[32:].argmax(-1) == off[32:].argmax(-1)).float().mean() >= 0.75
    fused, unfused = outputs
    assert fused.token_ids[0] == unfused.token_ids[0]  # the prompt's step (40 tokens: never fused)
    # a decode step's best logprob moves little with its logits, whichever token wins a near-tie: compared while
    # both runs have fed the same tokens
    for i in range(1, len(fused.token_ids)):
        if fused.token_ids[:i] != unfused.token_ids[:i]:
            break
        assert abs(fused.logprobs[i].logprob - unfused.logprobs[i].logprob) <= 5 * noise, i

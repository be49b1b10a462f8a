"""Speculative decoding on the GPU: the Triton verify kernels against the torch reference at the real head shapes,
greedy output with MTP equal to greedy output without it (float32: the exact kernels), and the verify steps'
CUDA graphs (spec/graphs.py) against the same steps run eagerly (bfloat16); the same with penalties, logit_bias,
min_tokens and grammars on the verified positions."""

import pytest
import torch
from hf_checkpoints import VOCAB

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.protocol.structured import StructuredOutputs

pytestmark = [pytest.mark.gpu, pytest.mark.spec]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_triton_verify_kernels_match_reference(state_dtype):
    from deltamesh.kernels import torch_ref, triton_verify

    torch.manual_seed(0)
    dev, n, w, hk, hv, d = "cuda", 16, 4, 16, 32, 128
    mixed = torch.randn(n * w, 2 * hk * d + hv * d, device=dev, dtype=torch.bfloat16)
    q = mixed[:, : hk * d].view(n * w, hk, d)
    k = mixed[:, hk * d : 2 * hk * d].view(n * w, hk, d)
    v = mixed[:, 2 * hk * d :].view(n * w, hv, d)
    a, b = torch.randn(n * w, hv, device=dev, dtype=torch.bfloat16), torch.randn(n * w, hv, device=dev)
    A_log, dt_bias = torch.rand(hv, device=dev).log(), torch.randn(hv, device=dev)
    pool = (torch.randn(2 * n + 1, hv, d, d, device=dev) * 0.1).to(state_dtype)
    idx = torch.randperm(2 * n, device=dev)[:n] + 1
    didx = torch.arange(n * w, device=dev).view(n, w)
    drafts, ref_drafts = (torch.zeros(n * w, hv, d, d, device=dev, dtype=state_dtype) for _ in range(2))
    ref = torch_ref.gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, idx, ref_drafts, didx)
    got = triton_verify.gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, idx, drafts, didx)
    scale = ref.float().abs().max()
    assert (got.float() - ref.float()).abs().max() / scale < 2e-2
    assert (drafts.float() - ref_drafts.float()).abs().max() < (1e-4 if state_dtype == torch.float32 else 2e-2)
    conv = torch.randn(2 * n + 1, 4096, 3, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(4096, 4, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n * w, 4096, device=dev, dtype=torch.bfloat16)
    cd, ref_cd = (torch.zeros(n * w, 4096, 3, device=dev, dtype=torch.bfloat16) for _ in range(2))
    ref_c = torch_ref.conv1d_verify(x, conv, idx, ref_cd, didx, weight)
    got_c = triton_verify.conv1d_verify(x, conv, idx, cd, didx, weight)
    assert torch.equal(cd, ref_cd)
    assert (got_c.float() - ref_c.float()).abs().max() / ref_c.float().abs().max() < 2e-2


def prompts(n=6):
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(5, 90, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def generate(path, **kw):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    settings = dict(model=str(path), device="cuda", page_size=16, max_num_seqs=8) | kw
    with Engine(EngineConfig(**settings)) as engine:
        outs = engine.generate(prompts(), params)
        return [o.token_ids for o in outs], engine.core.runner.graph_steps, engine.core.stats.spec_drafts


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_float32_greedy_output_with_mtp_equals_without(hf_checkpoints, family):
    plain, _, _ = generate(hf_checkpoints[family], dtype="float32")
    spec, _, drafts = generate(hf_checkpoints[family], dtype="float32", speculative_tokens=3)
    assert spec == plain and drafts > 0


def test_verify_steps_replayed_from_cuda_graphs_match_them_run_eagerly(hf_checkpoints):
    path = hf_checkpoints["qwen3_5_moe"]
    eager, eager_graphs, _ = generate(path, dtype="bfloat16", speculative_tokens=2, cuda_graphs=False)
    graphed, graph_steps, drafts = generate(path, dtype="bfloat16", speculative_tokens=2)
    assert eager_graphs == 0 and graph_steps > 0 and drafts > 0
    assert graphed == eager


def test_a_reduced_draft_vocabulary_in_the_verify_graphs_keeps_the_output_and_matches_eager(hf_checkpoints):
    """The drafter's reduced head (--speculative-draft-vocab, spec/draft_vocab.py): fp32 greedy output equals the
    output without MTP; inside the captured part 2 of the verify graphs (bf16: an fp32 model keeps the torch
    attention reference, which runs without graphs) replayed equals eager."""
    path = hf_checkpoints["qwen3_5_moe"]
    spec = dict(speculative_tokens=3, speculative_draft_vocab="100")
    plain, _, _ = generate(path, dtype="float32")
    exact, _, drafts = generate(path, dtype="float32", **spec)
    assert exact == plain and drafts > 0
    eager, eager_graphs, _ = generate(path, dtype="bfloat16", cuda_graphs=False, **spec)
    graphed, graph_steps, drafts = generate(path, dtype="bfloat16", **spec)
    assert eager_graphs == 0 and graph_steps > 0 and drafts > 0
    assert graphed == eager


# Penalties, logit_bias, min_tokens and grammars over the verified positions (CPU: tests/unit/test_spec_penalties.py
# and test_spec_structured.py): on CUDA the counts are updated on the device, xgrammar fills the K+1 positions'
# masks with its CUDA kernel, and a verify graph's output is adjusted in place
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "pet": {"enum": ["cat", "dog", "none"]}},
    "required": ["name", "pet"],
    "additionalProperties": False,
}
ADJUSTED = [
    SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA)),
    SamplingParams(
        max_tokens=40, temperature=0, presence_penalty=1.5, structured_outputs=StructuredOutputs(json=SCHEMA)
    ),
    SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,5}")),
    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(max_tokens=30, temperature=0, logit_bias={42: 3.0}, min_tokens=8),
    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),  # nothing adjusted, in the same steps
]
ADJUSTED_PROMPTS = ["A person:", "Another person:", "Code:", "The Python language", "A list is", "In this tutorial"]


def adjusted_outputs(**kw):
    """The default model (a tokenizer and a trained MTP module): ADJUSTED's requests together, to the end."""
    core = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), device="cuda", page_size=16, **kw))
    out: dict[str, list[int]] = {}
    done: set[str] = set()

    def sink(o):
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert o.error is None, o.error
        if o.finished:
            done.add(o.request_id)

    for i, (prompt, params) in enumerate(zip(ADJUSTED_PROMPTS, ADJUSTED, strict=True)):
        core.submit(core.make_request(prompt, params, f"r{i}"), sink)
    while len(done) < len(ADJUSTED):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    core.close()
    return out, core.stats, core.runner.graph_steps


def test_float32_greedy_output_with_penalties_and_grammars_with_mtp_equals_without():
    plain, _, _ = adjusted_outputs(dtype="float32")
    spec, stats, _ = adjusted_outputs(dtype="float32", speculative_tokens=3)
    assert spec == plain
    assert 0 < stats.spec_accepted < stats.spec_drafts and stats.grammar_mask_steps > 0


def test_verify_graphs_with_penalties_and_grammars_match_their_steps_run_eagerly():
    eager, _, eager_graphs = adjusted_outputs(dtype="bfloat16", speculative_tokens=2, cuda_graphs=False)
    graphed, stats, graph_steps = adjusted_outputs(dtype="bfloat16", speculative_tokens=2)
    assert eager_graphs == 0 and graph_steps > 0 and stats.spec_drafts > 0
    assert graphed == eager

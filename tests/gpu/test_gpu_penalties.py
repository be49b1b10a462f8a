"""Penalties, logit_bias and min_tokens on the GPU: the logits stage on CUDA follows the float64 reference while the
host lags a step behind, and decode steps of requests that all use them still replay CUDA graphs, with the same
tokens with async scheduling on and off."""

import pytest
import torch
from penalty_reference import reference_logits

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.engine.penalties import LogitAdjustments
from deltamesh.engine.request import Request, Status

pytestmark = pytest.mark.gpu
EOS = frozenset({0})


def test_the_logits_stage_on_cuda_follows_the_reference():
    vocab, cuda = 1000, torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=1.0),
        SamplingParams(logit_bias={5: 10.0, 6: -100.0}, min_tokens=2, stop_token_ids=[7]),
        SamplingParams(),
    ]
    reqs = []
    for i, p in enumerate(params):
        req = Request(f"r{i}", torch.randint(0, vocab, (50,), generator=gen).tolist(), p, None, EOS)
        req.status = Status.RUNNING
        reqs.append(req)
    adj = LogitAdjustments(vocab, cuda)
    outputs = {r.request_id: [] for r in reqs}
    for _ in range(4):  # the host never reads the tokens: only the device counts them
        raw = torch.randn(len(reqs), vocab, generator=gen)
        adjusted, counting = adj.apply(raw.to(cuda), reqs)  # in place on the device copy: no request asks logprobs
        for row, req in enumerate(reqs):
            want = reference_logits(raw[row], req.prompt_ids, outputs[req.request_id], req.params, EOS)
            got = adjusted[row].cpu().double()
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            assert torch.allclose(got[~torch.isinf(want)], want[~torch.isinf(want)], atol=1e-4)
        tokens = adjusted.argmax(-1)
        adj.count(counting, tokens)
        for req, token in zip(reqs, tokens.tolist()):
            outputs[req.request_id].append(token)
            req.num_pending += 1


def test_penalized_decode_steps_replay_cuda_graphs_and_async_scheduling_changes_nothing():
    prompts = ["The Python language", "A list is", "In this tutorial, we", "The module provides"]
    params = SamplingParams(
        max_tokens=32, temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={42: 2.0}
    )
    results = []
    for async_scheduling in (False, True):
        # bfloat16: an fp32 model keeps the torch attention reference, which runs without CUDA graphs
        cfg = EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="bfloat16", async_scheduling=async_scheduling)
        with Engine(cfg) as engine:
            before = engine.core.runner.graph_steps
            results.append([o.token_ids for o in engine.generate(prompts, params)])
            assert engine.core.runner.graph_steps - before >= 20  # the decode steps, from their graphs
    assert results[0] == results[1]

"""Penalties against independent references, on transformers' own Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models (tiny
random checkpoints): greedy with repetition_penalty equals transformers' generate(repetition_penalty=...) token for
token, requests with different penalties sharing the engine's batch; presence and frequency penalties, logit_bias and
min_tokens follow a float64 reference written from OpenAI's definition (tests/penalty_reference.py) over
transformers' logits at every generated position."""

from dataclasses import replace

import pytest
import torch
from hf_checkpoints import load_hf
from penalty_reference import reference_logits
from test_transformers_fidelity import FAMILIES, hf_logits, prompt

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore

pytestmark = pytest.mark.fidelity


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_model(hf_checkpoints, family):
    return load_hf(hf_checkpoints[family])


@pytest.fixture(scope="module")
def core(hf_checkpoints, family):
    return EngineCore(
        EngineConfig(model=str(hf_checkpoints[family]), page_size=8, max_num_seqs=8, max_num_batched_tokens=64)
    )


def run_batch(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Every request submitted at once, so they share steps; each one's tokens."""
    reqs = [core.make_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    tokens = {r.request_id: [] for r in reqs}
    done = set()

    def sink(out):
        tokens[out.request_id] += out.new_token_ids
        if out.finished:
            done.add(out.request_id)

    for r in reqs:
        core.submit(r, sink)
    while len(done) < len(reqs):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    return [tokens[r.request_id] for r in reqs]


def test_greedy_with_repetition_penalty_equals_transformers(core, hf_model):
    penalties = [1.3, 0.75, 2.0, 1.0]
    n = 16
    prompts = [prompt(length, seed=40 + i) for i, length in enumerate([37, 5, 60, 12])]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repetition_penalty=r) for r in penalties]
    got = run_batch(core, prompts, params)
    for ids, r, tokens in zip(prompts, penalties, got):
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, repetition_penalty=r
        )
        assert tokens == ref[0, len(ids) :].tolist(), r


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=1.2, presence_penalty=-0.5),
    SamplingParams(logit_bias={7: 6.0, 11: -100.0, 13: 2.5}),
    SamplingParams(min_tokens=6, stop_token_ids=[21], logit_bias={21: 30.0}),  # 21 wins once min_tokens is reached
    SamplingParams(repetition_penalty=1.4, frequency_penalty=0.8, presence_penalty=0.3, logit_bias={3: 1.0}),
    SamplingParams(frequency_penalty=2.0, logit_bias={9: 12.0}),  # 9 until its count outweighs the bias
]


def test_penalties_bias_and_min_tokens_follow_openai_definition_over_transformers_logits(core, hf_model):
    """At every generated position, the engine's greedy token is the argmax of the reference's adjusted logits (up
    to the float32 noise between two implementations of the model: 1e-3, far below any penalty here)."""
    prompts = [prompt(20 + 7 * i, seed=60 + i) for i in range(len(CASES))]
    params = [replace(p, max_tokens=14, temperature=0, ignore_eos=True) for p in CASES]
    got = run_batch(core, prompts, params)
    assert got[3][:6].count(21) == 0 and got[3][6:] == [21]  # stopped on it as soon as min_tokens allowed
    assert got[5][0] == 9 and got[5].count(9) < 14
    for ids, p, tokens in zip(prompts, params, got):
        logits = hf_logits(hf_model, ids + tokens)
        for t, token in enumerate(tokens):
            ref = reference_logits(logits[len(ids) - 1 + t], ids, tokens[:t], p, frozenset())
            assert ref[token] >= ref.max() - 1e-3, (p, t, token, int(ref.argmax()))

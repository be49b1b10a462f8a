"""Sampled output with speculative decoding keeps the model's distribution: an engine with K = 2 samples four tokens
per request, all but the first from verify steps whose drafts are the greedy continuation (accepted where the sample
follows it, rejected elsewhere), 1,500 requests of one prompt with their own seeds; the sequences' frequencies are
tested against the model's exact joint distribution (top-k 4 at temperature 0.8: 256 sequences, the rarest pooled)
by a chi-square test at significance 1e-3 (fixed seeds: the test is deterministic; a correct engine fails such a
test once in a thousand seed sets)."""

from collections import Counter

import pytest
import torch
from fidelity.test_transformers_fidelity import engine_logits
from hf_checkpoints import VOCAB
from spec_drafts import ReferenceDrafter
from test_spec_accept import ALPHA, chi_square_p_value
from test_spec_engine import engine, run

from deltamesh.engine import SamplingParams
from deltamesh.engine.sampling import _filter

pytestmark = pytest.mark.spec
N = 1500


def joint_distribution(core, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple, float]:
    """{tokens: probability} of every continuation of `length` tokens the filtered sampler can produce."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in joint.items():
            ids = prompt + list(seq)
            probs = _filter(engine_logits(core, ids, [len(ids)])[-1:], [params])[0].double()
            for tok in probs.nonzero().squeeze(1).tolist():
                grown[(*seq, tok)] = p * float(probs[tok])
        joint = grown
    return joint


def sampling_case(path) -> tuple[list[int], list[SamplingParams], dict[tuple[int, ...], float], list[int]]:
    """The prompt, N seeded samplings of 4 tokens, their exact joint distribution and the greedy continuation, from
    the engine without MTP."""
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    params = [SamplingParams(max_tokens=4, temperature=0.8, top_k=4, seed=i, ignore_eos=True) for i in range(N)]
    plain = engine(path, 0, max_num_seqs=64)
    joint = joint_distribution(plain, prompt, params[0], 4)
    greedy = run(plain, [prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))["r0"]
    return prompt, params, joint, greedy


def test_sampled_sequences_follow_the_models_joint_distribution(hf_checkpoints):
    path = hf_checkpoints["qwen3_5"]
    prompt, params, joint, greedy = sampling_case(path)
    core = engine(path, 2, max_num_seqs=64, speculative_disable_batch_size=64)  # every decode step verifies
    assert_follows(sample_with_greedy_drafts(core, prompt, params, greedy), joint)
    # the drafts were verified, some accepted and some rejected
    assert core.stats.spec_drafts >= 2 * N and 0 < core.stats.spec_accepted < core.stats.spec_drafts


def sample_with_greedy_drafts(core, prompt: list[int], params: list[SamplingParams], greedy: list[int]) -> Counter:
    """How often each continuation came out of `params` (one request each, submitted together) on `core`, whose
    drafts are the greedy continuation (accepted where a sample follows it, rejected elsewhere)."""
    ids = [f"s{i}" for i in range(len(params))]
    core.runner.spec.drafter = ReferenceDrafter({rid: prompt + greedy + [0] * 4 for rid in ids}, VOCAB)
    return sample_counts(core, prompt, params)


def sample_counts(core, prompt: list[int], params: list[SamplingParams]) -> Counter:
    """How often each continuation came out of `params` (one request each, request i named s<i>, submitted
    together) on `core` with its drafter."""
    ids = [f"s{i}" for i in range(len(params))]
    results, finals = {}, {}

    def sink(out):
        results.setdefault(out.request_id, []).extend(out.new_token_ids)
        finals[out.request_id] = out.finished

    for rid, p in zip(ids, params):
        core.submit(core.make_request(prompt, p, rid), sink)
    while sum(finals.values()) < len(ids):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    return Counter(tuple(results[rid]) for rid in ids)


def assert_follows(counts: Counter, joint: dict[tuple[int, ...], float]) -> None:
    """The sampled continuations follow `joint` (chi-square at ALPHA); none is one `joint` cannot produce."""
    n = sum(counts.values())
    assert all(len(seq) == len(next(iter(joint))) for seq in counts)
    assert not set(counts) - set(joint), "a sequence the model cannot produce"
    # the chi-square approximation wants >= 5 expected per cell: the rarest sequences are pooled into one cell
    common = [seq for seq, p in joint.items() if p * n >= 5]
    rare = [seq for seq in joint if seq not in set(common)]
    observed = torch.tensor([counts[s] for s in common] + [sum(counts[s] for s in rare)], dtype=torch.float64)
    expected = torch.tensor([joint[s] for s in common] + [sum(joint[s] for s in rare)], dtype=torch.float64)
    assert chi_square_p_value(observed, expected) > ALPHA

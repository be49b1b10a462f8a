"""Penalties, logit_bias and min_tokens with speculative decoding: greedy output with K drafts per step equals
greedy output of the same requests without them, token for token, on every family, with async scheduling on and
off, when the drafts are the checkpoints' random MTP module's (nearly all rejected), the reference continuation
(all accepted: the counts and min_tokens' progress must follow every accepted run) or that continuation with a wrong
token (rejected mid-run: only emitted tokens may be counted); and across a prefill and a decode worker. Sampled
output keeps the penalized distribution (speculative sampling's target is the adjusted p)."""

import pytest
import torch
from fidelity.test_transformers_fidelity import engine_logits
from hf_checkpoints import VOCAB
from idle_pools import assert_idle
from penalty_reference import reference_logits
from spec_drafts import ReferenceDrafter, prefill_then_decode
from test_spec_engine import FAMILIES, engine, prompts
from test_spec_sampling import assert_follows, sample_with_greedy_drafts

from deltamesh.engine import FinishReason, SamplingParams
from deltamesh.engine.sampling import _filter

pytestmark = pytest.mark.spec

# A biased token under a frequency penalty comes again until its count outweighs the bias, so a count off by one
# (a draft counted that was not emitted, an accepted one missed) shows; the stop token min_tokens holds back is
# biased to come first.
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logit_bias={5: 10.0}, frequency_penalty=1.5),
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(max_tokens=20, temperature=0, min_tokens=6, stop_token_ids=[3, 7], logit_bias={3: 8.0}),
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(
        max_tokens=20,
        temperature=0,
        ignore_eos=True,
        logit_bias={8: 12.0, 9: -100.0},
        frequency_penalty=2.0,
        presence_penalty=-0.5,
        repetition_penalty=0.7,
    ),
]


def run(core, ps, params=PARAMS):
    """Every prompt to the end with its own params, submitted at once; ({request id: tokens}, {id: final})."""
    results, finals = {}, {}

    def sink(out):
        results.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out

    ids = [f"r{i}" for i in range(len(ps))]
    for rid, p, sp in zip(ids, ps, params):
        core.submit(core.make_request(p, sp, rid), sink)
    while len(finals) < len(ps):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    assert not [out.error for out in finals.values() if out.error]
    return {rid: results[rid] for rid in ids}, finals


def continuations(ps, out):
    return {rid: p + tokens for (rid, tokens), p in zip(out.items(), ps)}


@pytest.fixture(scope="module")
def references(hf_checkpoints):
    """{family: greedy outputs of PARAMS' requests without speculative decoding}."""
    ps, refs = prompts(len(PARAMS), seed=5), {}
    for f in FAMILIES:
        refs[f], finals = run(engine(hf_checkpoints[f], 0), ps)
        # min_tokens held the biased stop token back, then it ended the request
        assert 3 not in refs[f]["r3"][:6] and refs[f]["r3"][-1] == 3 and len(refs[f]["r3"]) > 6
        assert finals["r3"].finish_reason == FinishReason.STOP
        assert refs[f]["r1"].count(5) > 1  # the biased token came again before its count outweighed the bias
    return refs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_output_with_mtp_drafts_equals_greedy_output_without(hf_checkpoints, references, family, k):
    core = engine(hf_checkpoints[family], k)
    assert run(core, prompts(len(PARAMS), seed=5))[0] == references[family]
    assert core.stats.spec_drafts > 0
    assert_idle(core)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_accepted_drafts_are_counted_as_they_are_emitted(hf_checkpoints, references, family, async_scheduling, k):
    ps = prompts(len(PARAMS), seed=5)
    core = engine(hf_checkpoints[family], k, async_scheduling=async_scheduling)
    core.runner.spec.drafter = ReferenceDrafter(continuations(ps, references[family]), VOCAB)
    assert run(core, ps)[0] == references[family]
    assert core.stats.spec_accepted > 0.7 * core.stats.spec_drafts
    assert_idle(core)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("wrong_at", [1, 4, 6])
def test_a_rejected_draft_is_not_counted(hf_checkpoints, references, family, wrong_at):
    """The draft at output index `wrong_at` is wrong (4 and 6: around r3's min_tokens, its stop token's turn)."""
    ps = prompts(len(PARAMS), seed=5)
    core = engine(hf_checkpoints[family], 3)
    core.runner.spec.drafter = ReferenceDrafter(continuations(ps, references[family]), VOCAB, wrong_at=wrong_at)
    assert run(core, ps)[0] == references[family]
    assert 0 < core.stats.spec_accepted < core.stats.spec_drafts
    assert_idle(core)


def test_a_drafted_stop_token_before_min_tokens_is_rejected(hf_checkpoints, references):
    """Drafts that propose r3's stop token at every position: min_tokens holds it back at the positions before its
    sixth token, so verification rejects it there, and takes it where the reference does."""
    family, ps = "qwen3_5", prompts(len(PARAMS), seed=5)
    ref = references[family]
    refs = continuations(ps, ref)
    refs["r3"] = ps[3] + [3] * 20
    core = engine(hf_checkpoints[family], 3)
    core.runner.spec.drafter = ReferenceDrafter(refs, VOCAB)
    assert run(core, ps)[0] == ref


def test_a_held_prefill_state_resumes_on_a_decode_engine_with_its_counts(hf_checkpoints, references):
    """P/D without a transport (as test_spec_engine's): the decode engine builds each request's rows from its prompt
    and first token, then verifies the prefill worker's drafts with them."""
    path, ps = hf_checkpoints["qwen3_5"], prompts(len(PARAMS), seed=5)
    want = references["qwen3_5"]
    prefill, decode = engine(path, 3), engine(path, 2)
    prefill.runner.spec.drafter = decode.runner.spec.drafter = ReferenceDrafter(continuations(ps, want), VOCAB)
    results = prefill_then_decode(prefill, decode, [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, PARAMS))])
    assert results == want and decode.stats.spec_accepted > 0.7 * decode.stats.spec_drafts
    assert_idle(prefill)
    assert_idle(decode)


N = 1500


def penalized_joint_distribution(core, prompt, params, length, eos):
    """{tokens: probability} of every continuation of `length` tokens, each step's logits through the reference
    logits stage (tests/penalty_reference.py) before the sampler's filters."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in joint.items():
            ids = prompt + list(seq)
            raw = engine_logits(core, ids, [len(ids)])[-1]
            logits = reference_logits(raw, prompt, list(seq), params, eos).float()
            probs = _filter(logits[None], [params])[0].double()
            for tok in probs.nonzero().squeeze(1).tolist():
                grown[(*seq, tok)] = p * float(probs[tok])
        joint = grown
    return joint


def test_sampled_sequences_follow_the_penalized_joint_distribution(hf_checkpoints):
    """As test_spec_sampling's, with a presence penalty and a bias: the drafts are the unpenalized greedy
    continuation, so a target p without the stage would accept them too often (and the chi-square test fails)."""
    path = hf_checkpoints["qwen3_5"]
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    plain = engine(path, 0, max_num_seqs=64)
    greedy = run(plain, [prompt], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])[0]["r0"]
    adjust = dict(presence_penalty=2.0, logit_bias={greedy[1]: -1.5})
    params = [
        SamplingParams(max_tokens=4, temperature=0.8, top_k=4, seed=i, ignore_eos=True, **adjust) for i in range(N)
    ]
    joint = penalized_joint_distribution(plain, prompt, params[0], 4, plain.request_builder.eos_token_ids)

    core = engine(path, 2, max_num_seqs=64, speculative_disable_batch_size=64)  # every decode step verifies
    assert_follows(sample_with_greedy_drafts(core, prompt, params, greedy), joint)
    assert core.stats.spec_drafts >= 2 * N and 0 < core.stats.spec_accepted < core.stats.spec_drafts

"""Structured outputs with speculative decoding, on the default model (it has a tokenizer, and an MTP module trained
to draft for it): greedy output under a JSON schema, a regex, a choice, EBNF or any JSON object with K drafts per step
equals greedy output without them, token for token, with async scheduling on and off, when the drafts are the MTP
module's (accepted often, and rejected where the grammar refuses them or the model differs), the reference
continuation (all accepted: each matcher advanced through them) or that continuation with a wrong token (rejected
mid-run: the matcher rolled back to the accepted prefix); sampled output follows its grammar."""

import json
import re

import jsonschema
import pytest
from idle_pools import assert_idle
from spec_drafts import ReferenceDrafter, prefill_then_decode
from test_spec_penalties import continuations, run
from test_structured_outputs import PERSON

from deltamesh.engine import DEFAULT_MODEL, EngineConfig, FinishReason, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.protocol.structured import StructuredOutputs

pytestmark = pytest.mark.spec

REGEX = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]*)?"
CHOICES = ["yes", "no", "maybe not", "ünïcode 中"]
PROMPTS = ["A person:", "Code:", "Pick:", "{", "Say:", "A person:", "The Python language"]


def structured(spec: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 60, "temperature": 0} | kw), structured_outputs=spec)


PARAMS = [
    structured(StructuredOutputs(json=PERSON)),
    structured(StructuredOutputs(regex=REGEX)),
    structured(StructuredOutputs(choice=CHOICES), ignore_eos=True),  # the grammar's end ends it all the same
    structured(StructuredOutputs(json_object=True)),
    structured(StructuredOutputs(grammar='root ::= ("ab" | "ba")+ "." | "x" [0-9]+')),
    # with the logits stage after the mask: a presence penalty and a bias against the schema's likeliest start
    structured(StructuredOutputs(json=PERSON, disable_any_whitespace=True), presence_penalty=1.5),
    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),  # no grammar in the same steps
]


def engine(k: int, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(DEFAULT_MODEL), page_size=4, speculative_tokens=k, **kw))


def text(core: EngineCore, tokens: list[int]) -> str:
    """The output's text, its ending EOS token left out."""
    return core.tokenizer.decode([t for t in tokens if t not in core.request_builder.eos_token_ids])


@pytest.fixture(scope="module")
def reference():
    core = engine(0)
    out, finals = run(core, PROMPTS, PARAMS)
    assert re.fullmatch(REGEX, text(core, out["r1"])) and text(core, out["r2"]) in CHOICES
    assert finals["r2"].finish_reason == FinishReason.STOP
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_structured_output_with_mtp_drafts_equals_greedy_output_without(reference, k, async_scheduling):
    core = engine(k, async_scheduling=async_scheduling)
    assert run(core, PROMPTS, PARAMS)[0] == reference
    assert 0 < core.stats.spec_accepted < core.stats.spec_drafts and core.stats.grammar_mask_steps > 0
    assert_idle(core)


@pytest.mark.parametrize("wrong_at", [None, 1, 4])
def test_drafts_of_the_reference_are_followed_by_the_matchers_and_a_wrong_one_rolled_back(reference, wrong_at):
    core = engine(3)
    prompts = [core.request_builder.build(p, PARAMS[0]).prompt_ids for p in PROMPTS]
    vocab = core.runner.model.cfg.vocab_size
    core.runner.spec.drafter = ReferenceDrafter(continuations(prompts, reference), vocab, wrong_at=wrong_at)
    assert run(core, PROMPTS, PARAMS)[0] == reference
    stats = core.stats
    if wrong_at is None:
        assert stats.spec_accepted > 0.7 * stats.spec_drafts
    else:
        assert 0 < stats.spec_accepted < stats.spec_drafts
    assert_idle(core)


def test_sampled_structured_output_follows_its_grammar():
    core = engine(3)
    seeds = range(6)
    params = [structured(StructuredOutputs(json=PERSON), temperature=1.0, seed=s, max_tokens=700) for s in seeds]
    params += [structured(StructuredOutputs(regex=REGEX), temperature=1.0, seed=s) for s in seeds]
    out, finals = run(core, ["A person:"] * len(seeds) + ["Code:"] * len(seeds), params)
    for i in seeds:
        assert finals[f"r{i}"].finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(text(core, out[f"r{i}"])), PERSON)
        assert re.fullmatch(REGEX, text(core, out[f"r{i + len(seeds)}"]))
    assert core.stats.spec_accepted > 0


def test_the_same_output_under_preemption(reference):
    """Pools too small for every request: requests are preempted and recomputed, each keeps its matcher (fed only
    the tokens it emitted, never a draft)."""
    # 24 pages (not 40): few enough that preemption happens whatever the grammars' compile timing lets run first
    core = engine(2, num_kv_pages=24, max_num_batched_tokens=16)
    assert run(core, PROMPTS, PARAMS)[0] == reference
    assert core.scheduler.num_preemptions > 0
    assert_idle(core)


def test_a_held_prefill_state_with_its_drafts_resumes_under_its_grammar_on_a_decode_engine(reference):
    """P/D without a transport (as test_spec_engine's): the prefill engine samples the first token under the grammar
    and drafts after it (unmasked: drafts need not follow the grammar); the decode engine's matcher replays the
    first token and masks the verified positions of its first step, those drafts included."""
    prefill, decode = engine(3), engine(2)
    requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
    results = prefill_then_decode(prefill, decode, requests)
    assert results == reference and decode.stats.spec_accepted > 0
    assert_idle(prefill)
    assert_idle(decode)

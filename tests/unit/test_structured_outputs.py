"""Structured outputs in the engine (engine/grammar.py) on the default model, whose weights are random: every output
follows its grammar (checked by an independent checker: jsonschema, Python's re), sampled or greedy, with the
tokens a grammar masks at logprob -inf; a grammar that terminates ends the request; a request whose grammar is
still compiling runs its prompt but does not hold up the others; the output is the same under preemption and when
a prefill engine hands the request to a decode engine (its matcher replays the first token)."""

import json
import re
import threading

import jsonschema
import pytest
from idle_pools import assert_idle
from test_engine import copy_state, run_all

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, FinishReason, RequestError, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.engine.grammar import MAX_JSON_WHITESPACE, xgrammar
from deltamesh.protocol.structured import StructuredOutputs

# What OpenAI's strict mode asks of a schema (every property required, no others), with values the default model's
# small vocabulary can spell and that end: bounded strings and integers, an enum, a boolean.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
# Enough for the longest output PERSON allows: a run of whitespace (one token per character at worst) in each of its
# 17 gaps between elements, and the values.
MAX_TOKENS = 17 * MAX_JSON_WHITESPACE + 64


@pytest.fixture(scope="module", params=[0, 2], ids=["plain", "mtp2"])
def engine(request):
    """The default model's engine, and with speculative decoding (its MTP's drafts, masked per verified position)."""
    with Engine(EngineConfig(model=str(DEFAULT_MODEL), speculative_tokens=request.param)) as e:
        yield e


def params(spec: StructuredOutputs, temperature=0.0, seed=None, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        temperature=temperature,
        seed=seed,
        structured_outputs=spec,
        **kw,
    )


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_json_schema_output_validates_against_its_schema(engine, temperature, seed):
    out = engine.generate("A person:", params(StructuredOutputs(json=PERSON), temperature, seed))[0]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason in engine.core.request_builder.eos_token_ids
    jsonschema.validate(json.loads(out.text), PERSON)


def test_compact_json_object_regex_choice_and_ebnf(engine):
    compact = engine.generate(
        "A person:", params(StructuredOutputs(json=PERSON, disable_any_whitespace=True), 1.0, seed=4)
    )[0]
    value = json.loads(compact.text)
    jsonschema.validate(value, PERSON)
    assert compact.text == json.dumps(value, ensure_ascii=False)  # one space after , and : only

    obj = engine.generate("{", params(StructuredOutputs(json_object=True), 1.0, seed=3, max_tokens=2048))[0]
    assert obj.finish_reason == FinishReason.STOP and isinstance(json.loads(obj.text), dict)

    pattern = r"[0-9]{3}-[a-z]{2,5}( [A-Z][a-z]*)?"
    for seed in range(3):
        out = engine.generate("Code:", params(StructuredOutputs(regex=pattern), 1.0, seed))[0]
        assert out.finish_reason == FinishReason.STOP and re.fullmatch(pattern, out.text)

    choices = ["yes", "no", 'a "quoted" \\ choice', "ünïcode 中"]
    seen = {engine.generate("Pick:", params(StructuredOutputs(choice=choices), 1.0, s))[0].text for s in range(8)}
    assert seen <= set(choices) and len(seen) > 1

    ebnf = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    out = engine.generate("Sum:", params(StructuredOutputs(grammar=ebnf), 1.0, seed=5))[0]
    assert out.finish_reason == FinishReason.STOP and re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", out.text)


def test_logprobs_are_of_the_masked_distribution(engine):
    """As vLLM reports them: a JSON object's first token can only be "{", so its logprob is 0 and every other
    token's -inf."""
    out = engine.generate("{", params(StructuredOutputs(json_object=True), logprobs=5, max_tokens=1))[0]
    first = out.logprobs[0]
    assert engine.tokenizer.decode([first.token_id]) == "{" and first.logprob == 0.0
    assert first.top[0] == (first.token_id, 0.0) and all(lp == float("-inf") for _, lp in first.top[1:])


def test_a_terminated_grammar_ends_the_request_even_with_ignore_eos(engine):
    out = engine.generate("Pick:", params(StructuredOutputs(choice=["yes", "no"]), 1.0, 7, ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.STOP and out.text in ("yes", "no")
    assert out.token_ids[-1] in engine.core.request_builder.eos_token_ids


def test_special_tokens_are_never_text_under_a_grammar(engine):
    """A grammar that allows any text (a JSON string) still never allows a special token, which the detokenizer
    would drop from the text, nor a token id past the tokenizer's vocabulary."""
    xgr = xgrammar()
    grammar = engine.core.grammars.start(StructuredOutputs(regex='"[^"]*"'))
    grammar._compiled.result(timeout=60)
    grammar.advance([engine.tokenizer.token_id('"')])
    bitmask = xgr.allocate_token_bitmask(1, engine.core.model_config.vocab_size)
    grammar.matcher.fill_next_token_bitmask(bitmask)
    allowed = {t for t in range(engine.core.model_config.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1}
    backend = engine.tokenizer.backend
    special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    assert allowed and not allowed & special
    assert max(allowed) < backend.get_vocab_size(with_added_tokens=True)


def test_bad_specs_are_refused_when_the_request_is_made(engine):
    for spec, message in (
        (StructuredOutputs(json={"type": "objec"}), r"invalid structured output json: .*objec"),
        (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "invalid structured output json"),
        (StructuredOutputs(regex="[a-"), r"invalid structured output regex: .*Unclosed '\['"),
        (StructuredOutputs(regex="(?<=a)b"), "Lookbehind is not supported"),
        (StructuredOutputs(grammar="root ::= foo"), r"invalid structured output grammar: .*foo"),
    ):
        with pytest.raises(RequestError, match=message):
            engine.make_request("x", params(spec))
    with pytest.raises(RequestError, match="exactly one of"):
        engine.make_request("x", params(StructuredOutputs(regex="a", grammar='root ::= "a"')))
    deep = {"type": "array", "items": {}}
    for _ in range(64):
        deep = {"type": "array", "items": deep}
    with pytest.raises(RequestError, match="nests deeper than 64"):
        engine.make_request("x", params(StructuredOutputs(json=deep)))


def test_a_request_whose_grammar_compiles_does_not_hold_up_the_batch(engine):
    """The compile is held back (a gate around the real one); meanwhile another request runs to its end, and the
    waiting one has run all its prompt but the token that samples, and sampled nothing."""
    grammars = engine.core.grammars
    gate, compiled = threading.Event(), grammars._compile
    grammars._compile = lambda grammar: gate.wait(120) and compiled(grammar)
    done, tokens = threading.Event(), []
    try:
        prompt = engine.tokenizer.encode("A long enough prompt for a chunk or two")
        waiting = engine.make_request(prompt, params(StructuredOutputs(regex="[a-z]{4,8}"), 1.0, seed=9))
        engine.submit(waiting, lambda out: (tokens.extend(out.new_token_ids), out.finished and done.set()))
        plain = engine.generate("Other", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
        assert len(plain.token_ids) == 24 and plain.finish_reason == FinishReason.LENGTH
        assert not tokens and not done.is_set() and waiting.num_computed == len(prompt) - 1
    finally:
        del grammars._compile
        gate.set()
    assert done.wait(60)
    assert re.fullmatch("[a-z]{4,8}", engine.tokenizer.decode(tokens[:-1])) and tokens[-1] in waiting.eos_token_ids


def test_same_outputs_under_preemption(engine):
    """Pools too small for every request: requests are preempted and recomputed; each keeps its matcher, and the
    outputs are those of an engine with room for all, and of one that finishes every step before the next (no
    async scheduling: the matchers are up to date at launch)."""
    specs = [
        StructuredOutputs(json=PERSON, disable_any_whitespace=True),
        StructuredOutputs(regex="[a-z]{30,40}"),
        StructuredOutputs(choice=["alpha beta gamma delta", "one two three four five"]),
        StructuredOutputs(json=PERSON, disable_any_whitespace=True),
    ]
    texts = ["A person:", "Letters:", "Pick one of two:", "Someone:"]

    def run(core: EngineCore) -> dict:
        reqs = [
            core.make_request(t, params(s, 1.0, seed=i, max_tokens=60), f"r{i}")
            for i, (t, s) in enumerate(zip(texts, specs))
        ]
        tokens, finals = run_all(core, reqs)
        assert all(f.finish_reason == FinishReason.STOP for f in finals.values())
        return tokens

    roomy = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), page_size=4))
    small = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), page_size=4, num_kv_pages=20, max_num_batched_tokens=16))
    in_order = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), page_size=4, async_scheduling=False))
    assert run(small) == run(roomy) == run(in_order)
    assert small.scheduler.num_preemptions > 0
    assert_idle(small)


def test_a_transferred_request_replays_its_first_token_into_its_matcher():
    """The P/D boundary without a transport (as test_engine's): the prefill engine samples the first token under
    the grammar, the decode engine's matcher is fed it before the request samples again; the whole output is the
    monolithic engine's, sampled and greedy."""
    ps = ["A person:", "Another one:"]
    cases = [
        (StructuredOutputs(json=PERSON, disable_any_whitespace=True), 1.0),
        (StructuredOutputs(regex="[a-z]{9}"), 0.0),
    ]
    config = EngineConfig(model=str(DEFAULT_MODEL), page_size=4)
    mono, prefill, decode = EngineCore(config), EngineCore(config), EngineCore(config)
    for spec, temperature in cases:
        p = params(spec, temperature, seed=21)
        ref, _ = run_all(mono, [mono.make_request(t, p, f"r{i}") for i, t in enumerate(ps)])
        reqs = [prefill.make_request(t, p, f"r{i}", hold_state=True) for i, t in enumerate(ps)]
        first, _ = run_all(prefill, reqs)
        got = {}
        for req in reqs:
            rid = req.request_id
            reservation = decode.reservations.reserve(len(req.prompt_ids))
            copy_state(prefill, decode, rid, reservation, len(req.prompt_ids))
            assert prefill.held.release(rid)
            continued = decode.make_request(req.prompt_ids, p, rid)
            sink = lambda out, rid=rid: got.setdefault(rid, []).extend(out.new_token_ids)  # noqa: E731
            decode.submit_transferred(continued, first[rid][0], reservation, sink)
        while decode.has_work or not decode._commands.empty():
            decode.dispatch(decode.process_commands())
            decode.dispatch(decode.step())
        assert {rid: first[rid] + got[rid] for rid in got} == ref
    assert_idle(decode)


def test_a_grammar_that_fails_to_compile_ends_its_request_with_the_reason(engine):
    """Parsing passed, compiling failed (here: made to raise): the request ends with an error saying so, and the
    batch it was in goes on."""
    grammars = engine.core.grammars

    def failing(grammar):
        raise RuntimeError("[00:00:00] /project/cpp/compiler.cc:1: out of memory")

    grammars._compile = failing
    try:
        doomed = engine.make_request("x", params(StructuredOutputs(regex="[0-9]{2}")))
    finally:
        del grammars._compile
    done, finals = threading.Event(), []
    engine.submit(doomed, lambda out: out.finished and (finals.append(out), done.set()))
    other = engine.generate("Other", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert done.wait(60) and other.finish_reason == FinishReason.LENGTH
    assert finals[0].finish_reason == FinishReason.ERROR and not finals[0].new_token_ids
    assert finals[0].error == "the structured output grammar failed to compile: out of memory"


def test_a_grammar_that_matches_nothing_ends_its_request_saying_so(engine):
    """A regex that parses but no text matches (a class of no character): nothing is allowed, the sampled token is
    refused, and the error says that the grammar cannot be completed."""
    out = engine.generate("x", params(StructuredOutputs(regex="[^\\x00-\\U0010FFFF]"), max_tokens=4))[0]
    assert out.finish_reason == FinishReason.ERROR
    assert out.error == "the structured output grammar allows no token after 0 tokens: it cannot be completed"

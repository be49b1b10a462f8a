"""Penalties, logit_bias and min_tokens in the engine's step: a batch of requests with and without them, under
preemption, aborts and async scheduling, gives each request what it gets alone; a request whose prompt state
arrives from a prefill worker rebuilds its counts from the prompt and its first token; min_tokens holds back
end-of-sequence and stop strings, and include_stop_str_in_output keeps the stop string."""

import pytest
from idle_pools import assert_idle
from test_engine import copy_state, prompts, run_all

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, FinishReason, SamplingParams
from deltamesh.engine.core import EngineCore


@pytest.fixture(scope="module")
def model_dir(hf_checkpoints):
    return str(hf_checkpoints["qwen3_5"])


# A biased token with a frequency penalty comes again until its count outweighs the bias: counts off by one show.
MIXED = [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=13, temperature=0, ignore_eos=True, logit_bias={5: 10.0}, frequency_penalty=1.5),
    SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True, frequency_penalty=2.0, logprobs=2),
    SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, logit_bias={5: 4.0, 9: -100.0}),
    SamplingParams(max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=[3, 7], logit_bias={3: 8.0}),
    SamplingParams(
        max_tokens=14,
        temperature=0,
        ignore_eos=True,
        logit_bias={8: 12.0},
        frequency_penalty=2.0,
        repetition_penalty=0.7,
    ),
]


def alone(model_dir: str, ps: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    engine = EngineCore(EngineConfig(model=model_dir, page_size=4))
    out = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        tokens, _ = run_all(engine, [engine.make_request(p, sp, f"r{i}")])
        out.update(tokens)
    return out


def test_a_mixed_batch_equals_each_request_alone_under_preemption_aborts_and_async_scheduling(model_dir):
    ps = prompts(len(MIXED), seed=21)
    want = alone(model_dir, ps, MIXED)
    assert want["r5"][:6] != [3] * 6 and want["r5"][6] == 3  # min_tokens held the biased stop token back
    for async_scheduling in (False, True):
        engine = EngineCore(
            EngineConfig(
                model=model_dir,
                page_size=4,
                num_kv_pages=24,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                async_scheduling=async_scheduling,
            )
        )
        reqs = [engine.make_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(ps, MIXED))]

        def on_step(step, engine=engine):
            if step == 5:
                engine.abort("r1")

        tokens, finals = run_all(engine, reqs, on_step)
        assert engine.scheduler.num_preemptions > 0
        assert finals["r5"].finish_reason == FinishReason.STOP and finals["r5"].stop_reason == 3
        assert {k: v for k, v in tokens.items() if k != "r1"} == {k: v for k, v in want.items() if k != "r1"}
        assert_idle(engine)
        assert engine.launcher.adjustments.rows_in_use <= len(reqs)


def test_a_transferred_request_rebuilds_its_counts_from_the_prompt_and_its_first_token(model_dir):
    ps = prompts(4, seed=7)
    params = [
        # the biased token comes first and again until its count outweighs the bias: the count must hold the first
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={4: 10.0}, frequency_penalty=2.0),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=3.0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=2, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=8, logit_bias={4: 9.0}, stop_token_ids=[4]),
    ]
    ref = alone(model_dir, ps, params)
    prefill = EngineCore(EngineConfig(model=model_dir, page_size=4))
    decode = EngineCore(EngineConfig(model=model_dir, page_size=8))
    reqs = [prefill.make_request(p, sp, f"r{i}", hold_state=True) for i, (p, sp) in enumerate(zip(ps, params))]
    first, _ = run_all(prefill, reqs)
    got = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        rid = f"r{i}"
        res = decode.reservations.reserve(len(p))
        copy_state(prefill, decode, rid, res, len(p))
        assert prefill.held.release(rid)
        sink = lambda out, rid=rid: got.setdefault(rid, []).extend(out.new_token_ids)  # noqa: E731
        decode.submit_transferred(decode.make_request(p, sp, rid), first[rid][0], res, sink)
    while decode.has_work or not decode._commands.empty():
        decode.dispatch(decode.process_commands())
        decode.dispatch(decode.step())
    assert {rid: first[rid] + got[rid] for rid in got} == ref


def test_min_tokens_holds_back_eos_and_stop_strings_and_the_stop_string_can_be_kept():
    with Engine(EngineConfig(model=str(DEFAULT_MODEL))) as engine:
        eos = min(engine.core.request_builder.eos_token_ids)
        forced = dict(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
        [at_once] = engine.generate("A list is", SamplingParams(**forced))
        [held] = engine.generate("A list is", SamplingParams(**forced, min_tokens=5))
        assert at_once.token_ids == [eos] and held.token_ids[-1] == eos and len(held.token_ids) == 6
        assert held.finish_reason == FinishReason.STOP and eos not in held.token_ids[:5]

        [base] = engine.generate("The Python language", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        stop = base.text[4:7]
        first = base.text.index(stop)
        kw = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        [cut] = engine.generate("The Python language", SamplingParams(**kw))
        [kept] = engine.generate("The Python language", SamplingParams(**kw, include_stop_str_in_output=True))
        assert cut.text == base.text[:first] and kept.text == base.text[: first + len(stop)]
        assert cut.finish_reason == kept.finish_reason == FinishReason.STOP
        # with min_tokens past the first occurrence, it does not count: the text runs on past it
        tokens_to_first = next(n for n in range(1, 25) if stop in engine.tokenizer.decode(base.token_ids[:n]))
        [late] = engine.generate("The Python language", SamplingParams(**kw, min_tokens=tokens_to_first + 1))
        assert len(late.token_ids) > tokens_to_first and late.text.startswith(base.text[: first + len(stop)])


def test_a_prompt_served_from_the_prefix_cache_gets_the_same_tokens(model_dir):
    """The counts come from the prompt's ids, never from what was computed: a cached prefix changes nothing."""
    engine = EngineCore(EngineConfig(model=model_dir, page_size=4))
    prompt = prompts(1, seed=3)[0] + list(range(1, 33))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.5, presence_penalty=1.0)
    first, _ = run_all(engine, [engine.make_request(prompt, params, "a")])
    again, _ = run_all(engine, [engine.make_request(prompt, params, "b")])
    assert engine.stats.prefix_cache_hit_tokens > 0 and again["b"] == first["a"]

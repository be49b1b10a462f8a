"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) changes nothing a
client can see: the same tokens, logprobs, finish reasons and held states as finishing every step first; and it
never lets a launched step and a new owner share memory."""

import pytest
import torch
from idle_pools import assert_idle
from test_engine import prompts, run_all

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.engine.request import Status


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def model_dir(request, hf_checkpoints):
    return str(hf_checkpoints[request.param])


def core(model_dir, async_scheduling, **kw):
    kw = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 24, **kw}
    return EngineCore(EngineConfig(model=model_dir, async_scheduling=async_scheduling, **kw))


def mixed_requests(engine: EngineCore, stop_token: int):
    """Greedy, seeded, logprobs, a stop token, stop at max_tokens=1 and 2, one request longer than the budget."""
    ps = prompts(7, seed=5) + [list(range(1, 70))]
    params = [
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=2, temperature=0.7, seed=9, logprobs=0),
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    ]
    return [engine.make_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(ps, params))]


@pytest.mark.slow
def test_same_outputs_as_finishing_every_step(model_dir):
    sync_engine = core(model_dir, False)
    probe = sync_engine.make_request(prompts(7, seed=5)[3], SamplingParams(max_tokens=30, temperature=0), "p")
    free_run, _ = run_all(sync_engine, [probe])
    stop_token = free_run["p"][4]  # r3 stops on the first time it makes this token
    stops_after = free_run["p"].index(stop_token) + 1

    results = []
    for async_scheduling in (False, True):
        engine = core(model_dir, async_scheduling)
        got_lps = {}  # request id -> ([(token id, top ids) or None], [logprob or None]), one per token
        orig = engine._append_token

        def append(req, tok, lp, now, orig=orig, got_lps=got_lps):
            ids, values = got_lps.setdefault(req.request_id, ([], []))
            ids.append(None if lp is None else (lp.token_id, [t for t, _ in lp.top]))
            values.append(None if lp is None else lp.logprob)
            return orig(req, tok, lp, now)

        engine._append_token = append
        tokens, finals = run_all(engine, mixed_requests(engine, stop_token))
        results.append((tokens, {k: (v.finish_reason, v.stop_reason) for k, v in finals.items()}, got_lps))
        assert_idle(engine)
        assert not engine.has_work
    (sync_tokens, sync_finals, sync_lps), (tokens, finals, lps) = results
    assert tokens == sync_tokens and finals == sync_finals
    # the same tokens and top ids; log-probabilities to 1e-4, not rounded to four places and compared exactly
    # (a value near a rounding boundary lands either side of it on some CPUs)
    assert lps.keys() == sync_lps.keys()
    for rid, (ids, values) in lps.items():
        assert ids == sync_lps[rid][0], rid
        assert values == pytest.approx(sync_lps[rid][1], abs=1e-4), rid
    assert len(tokens["r3"]) == stops_after and finals["r3"][1] == stop_token
    assert len(tokens["r4"]) == 1 and len(tokens["r5"]) == 2


@pytest.mark.slow
def test_same_outputs_under_preemption_and_aborts(model_dir):
    """A pool too small for every request: running requests are preempted and recomputed, some while their
    last token is still pending; two requests are aborted while a step that contains them runs."""
    results = []
    for async_scheduling in (False, True):
        engine = core(model_dir, async_scheduling, num_kv_pages=24, max_num_batched_tokens=16)
        reqs = [
            engine.make_request(p, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True), f"r{i}")
            for i, p in enumerate(prompts(6, seed=8))
        ]

        def on_step(step, engine=engine):
            if step == 6:
                engine.abort("r1")
                engine.abort("r5")

        tokens, finals = run_all(engine, reqs, on_step)
        assert engine.scheduler.num_preemptions > 0
        assert_idle(engine)
        results.append({k: v for k, v in tokens.items() if k not in ("r1", "r5")})
    assert results[0] == results[1]


def test_prefill_only_state_is_the_state_after_the_prompt(model_dir):
    """A held request is never run ahead: its state is exactly the prompt's, byte for byte the same as when
    every step is finished first (running ahead would advance the GDN state past the hand-off point)."""
    held = []
    for async_scheduling in (False, True):
        engine = core(model_dir, async_scheduling, max_num_batched_tokens=16)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        reqs = [engine.make_request(p, params, f"r{i}", hold_state=True) for i, p in enumerate(prompts(3, seed=4))]
        first, _ = run_all(engine, reqs)
        assert all(len(t) == 1 for t in first.values())
        assert all(r.num_computed == len(r.prompt_ids) for r in reqs)
        held.append((first, [torch.cat([r.tensor for r in engine.held.regions(f"r{i}")]) for i in range(3)]))
    assert held[0][0] == held[1][0]
    for a, b in zip(held[0][1], held[1][1]):
        assert torch.equal(a, b)


def test_a_step_runs_ahead_of_its_tokens(model_dir):
    """The overlap itself: after a decode step is launched, its request's token is pending (not on the host)
    and the next step is already scheduled from it; a request that stopped meanwhile is skipped, not resumed."""
    engine = core(model_dir, True)
    req = engine.make_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "a")
    outs = []
    engine.submit(req, outs.append)
    engine.process_commands()
    assert engine.step() == []  # the prefill is launched, its token not read yet
    assert req.num_pending == 1 and req.output_ids == []
    engine.dispatch(engine.step())  # launches the decode fed by the pending token, then reads the first token
    assert len(outs) == 1 and len(req.output_ids) == 1 and req.num_pending == 1
    engine.abort("a")
    engine.dispatch(engine.process_commands())
    assert req.status == Status.FINISHED and outs[-1].finished
    engine.dispatch(engine.step())  # reads the in-flight token of an aborted request: dropped
    assert len(req.output_ids) == 1 and req.num_pending == 0 and not engine.has_work
    assert engine.kv_pool.num_used == 0 and engine.state_pool.num_used == 0


def test_a_steps_tokens_stream_during_the_next_launch(model_dir):
    """A step with prompt tokens takes the previous step's tokens between its layers once they are on the host
    (on the CPU at once): they reach the sink before that step's launch is over, not in what step() returns."""
    engine = core(model_dir, True)
    outs = []
    engine.submit(
        engine.make_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "a"), outs.append
    )
    engine.process_commands()
    engine.step()  # a's prompt
    engine.submit(engine.make_request(list(range(1, 20)), GREEDY4, "b"), outs.append)
    engine.process_commands()
    layers = []
    execute = engine.runner.execute
    engine.runner.execute = lambda items, pending, between_layers: execute(
        items, pending, lambda: (layers.append(len(outs)), between_layers())
    )
    assert engine.step() == []  # a's decode beside b's prompt: a's first token went out during the launch
    assert layers[0] == 0 and layers[1:] == [1] * (len(layers) - 1) and [o.request_id for o in outs] == ["a"]


GREEDY4 = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

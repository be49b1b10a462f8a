"""Engine behaviour: pool accounting, preemption, admission errors, streaming cancellation, and the
prefill-hold / decode-reserve state hand-over (in-process, without a transport)."""

import asyncio

import pytest
import torch
from hf_checkpoints import VOCAB
from idle_pools import assert_idle

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, FinishReason, RequestError, SamplingParams, assembly
from deltamesh.engine.cache import StatePool
from deltamesh.engine.core import EngineCore
from deltamesh.engine.runner import ModelRunner
from deltamesh.kernels import late_compiles

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def model_dir(hf_checkpoints):
    return str(hf_checkpoints["qwen3_5"])


def run_all(core: EngineCore, reqs, on_step=None):
    results = {r.request_id: [] for r in reqs}
    finals = {}

    def sink(out):
        results[out.request_id] += out.new_token_ids
        if out.finished:
            finals[out.request_id] = out

    for r in reqs:
        core.submit(r, sink)
    step = 0
    while len(finals) < len(reqs):
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
        if on_step:
            on_step(step)
        step += 1
    return results, finals


def test_pools_return_to_zero_after_finished_stopped_and_aborted(model_dir):
    core = EngineCore(EngineConfig(model=model_dir, page_size=4, max_num_seqs=4, max_num_batched_tokens=32))
    ps = prompts(8)
    reqs = [
        core.make_request(p, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True), f"r{i}")
        for i, p in enumerate(ps)
    ]
    # r1 stops on a token it is about to produce; r2 (running) and r7 (still queued) are aborted.
    alone = Engine(EngineConfig(model=model_dir)).generate(ps[1], SamplingParams(max_tokens=15, temperature=0))
    reqs[1].params.stop_token_ids = [alone[0].token_ids[3]]

    def on_step(step):
        if step == 2:
            core.abort("r2")
            core.abort("r7")

    _, finals = run_all(core, reqs, on_step)
    reasons = {rid: out.finish_reason for rid, out in finals.items()}
    assert reasons["r1"] == FinishReason.STOP and finals["r1"].num_output_tokens <= 4
    assert reasons["r2"] == reasons["r7"] == FinishReason.ABORT
    assert reasons["r0"] == FinishReason.LENGTH
    assert_idle(core)
    assert not core.requests and not core.scheduler.has_work


def test_preemption_under_kv_pressure_gives_the_same_tokens(model_dir):
    ps = prompts(6, seed=1)
    big = EngineCore(EngineConfig(model=model_dir, page_size=4))
    small = EngineCore(EngineConfig(model=model_dir, page_size=4, num_kv_pages=24, max_num_batched_tokens=16))
    ref, _ = run_all(big, [big.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(ps)])
    got, _ = run_all(small, [small.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(ps)])
    assert small.scheduler.num_preemptions > 0
    assert got == ref
    assert_idle(small)


def test_requests_that_cannot_fit_are_rejected_with_reasons(model_dir):
    core = EngineCore(EngineConfig(model=model_dir, page_size=4, num_kv_pages=8, max_model_len=100))
    with pytest.raises(RequestError, match="maximum context length is 100"):
        core.make_request([1] * 90, SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="KV pages"):
        core.make_request([1] * 40, SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="empty"):
        core.make_request([], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        core.make_request([VOCAB + 5], SamplingParams())
    with pytest.raises(RequestError, match="top_p"):
        core.make_request([1, 2], SamplingParams(top_p=0))


def test_leaving_a_stream_early_aborts_and_frees(model_dir):
    async def main(engine):
        got = 0
        async for out in engine.generate_stream(
            [5, 6, 7], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        ):
            got += len(out.new_token_ids)
            if got >= 3:
                break
        for _ in range(100):
            if engine.core.state_pool.num_used == 0:
                break
            await asyncio.sleep(0.02)
        return got

    with Engine(EngineConfig(model=model_dir)) as engine:
        assert 3 <= asyncio.run(main(engine)) < 200
        assert engine.core.state_pool.num_used == 0 and engine.core.kv_pool.num_used == 0


def test_held_prefill_state_resumes_on_another_engine_exactly(model_dir):
    """The disaggregation boundary without a transport: prefill holds the state after the prompt, its bytes
    are copied into the decode engine's reservation, and decoding resumes from the first sampled token."""
    ps = prompts(4, seed=2)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True)
    mono = EngineCore(EngineConfig(model=model_dir, page_size=4))
    ref, _ = run_all(mono, [mono.make_request(p, params, f"r{i}") for i, p in enumerate(ps)])

    prefill = EngineCore(EngineConfig(model=model_dir, page_size=4, max_num_batched_tokens=16))
    decode = EngineCore(EngineConfig(model=model_dir, page_size=8))  # other page size, other pool layout
    first, finals = run_all(
        prefill, [prefill.make_request(p, params, f"r{i}", hold_state=True) for i, p in enumerate(ps)]
    )
    assert len(prefill.held) == 4 and all(len(t) == 1 for t in first.values())
    assert all(out.finish_reason is None for out in finals.values())

    got = {}
    reqs = []
    decode.state_pool.recurrent.fill_(7.0)  # every slot is free: a reservation must leave its bytes as they are
    for i, p in enumerate(ps):
        rid = f"r{i}"
        res = decode.reservations.reserve(len(p))
        assert bool((decode.state_pool.recurrent[res.slot] == 7.0).all())  # left to the pull, not zeroed
        src = prefill.held.regions(rid)
        # KV pages differ in size between the two pools, so copy page contents token-range by token-range:
        # here both hold the same bytes per token, laid out page-major; compare through the pool views.
        copy_state(prefill, decode, rid, res, len(p))
        assert prefill.held.release(rid)
        req = decode.make_request(p, params, rid)
        decode.submit_transferred(
            req, first[rid][0], res, lambda out, rid=rid: got.setdefault(rid, []).extend(out.new_token_ids)
        )
        reqs.append(req)
        assert sum(r.nbytes for r in src) > 0
    while decode.has_work or not decode._commands.empty():
        decode.dispatch(decode.process_commands())
        decode.dispatch(decode.step())
    assert {rid: first[rid] + got[rid] for rid in got} == ref
    assert prefill.stats.first_tokens == 4 and decode.stats.queued == decode.stats.first_tokens == 0
    assert_idle(prefill)
    assert_idle(decode)


def copy_state(src: EngineCore, dst: EngineCore, rid: str, res, n_tokens: int):
    held = src.held.get(rid)
    for layer in range(src.kv_pool.num_layers):
        for kind in range(2):
            s = src.kv_pool.layer(layer)[kind][held.pages].flatten(0, 1)[:n_tokens]
            d = dst.kv_pool.layer(layer)[kind]
            for t in range(n_tokens):
                d[res.pages[t // dst.kv_pool.page_size], t % dst.kv_pool.page_size] = s[t]
    dst.state_pool.conv[res.slot] = src.state_pool.conv[held.slot]
    dst.state_pool.recurrent[res.slot] = src.state_pool.recurrent[held.slot]


def test_warm_up_runs_a_mixed_step_and_leaves_the_engine_empty(model_dir, monkeypatch):
    """GPU workers warm up before serving so that kernel compilation and autotuning stay out of requests; that
    must cover a step mixing decodes and prefills (a colocated worker's normal step), among them chunks that take
    checkpoints in passing from the scratch slot and from a free one, and leave nothing behind. Built as a GPU
    engine builds itself (CPU engines skip the warm-up): chunks take checkpoints only once the prefix cache is
    made, so the warm-up must come after it."""
    steps, passing = [], []
    execute = ModelRunner.execute

    def watched(runner, items, *a, **kw):
        steps.append(sorted(it.num_tokens for it in items))
        passing.append(
            {
                it.snapshot_slot
                for it in items
                if it.snapshot_at is not None
                and it.num_tokens > 1
                and it.request.num_computed + it.num_tokens > it.snapshot_at
            }
        )
        return execute(runner, items, *a, **kw)

    monkeypatch.setattr(ModelRunner, "execute", watched)
    monkeypatch.setattr(assembly, "WARM_UP_DEVICES", ("cpu",))
    core = EngineCore(EngineConfig(model=model_dir, page_size=4, max_num_seqs=6))  # a slot to lend
    late_compiles.WATCH.stop()  # the GPU engine's compile watch, started after its warm-up: not this process's
    # a decode beside four prefills, one of them a short tail: the shape whose first use cost seconds on a GPU
    assert any(s[0] == 1 and sum(n > 1 for n in s) == 4 and 1 < s[1] <= 2 for s in steps), steps
    assert any(StatePool.SCRATCH in slots and len(slots) == 2 for slots in passing), passing
    # prompt chunks of a multiple of 16 tokens and of others: Triton specializes integer arguments by it
    chunks = [n for s in steps for n in s if n > 1]
    assert any(n % 16 == 0 for n in chunks) and any(n % 16 for n in chunks), steps
    assert core.kv_pool.num_used == 0 and core.state_pool.num_used == 0
    assert core.prefix_cache is not None and core.prefix_cache.num_checkpoints == 0 and core.prefix_cache.num_pages == 0
    assert not core.requests and not core.scheduler.has_work and core.stats.steps == 0


def test_final_text_is_the_decode_of_the_output_ids():
    """Output that ends inside a multi-byte character: the streamed deltas plus the final flush equal the
    tokenizer's decode of the output ids (U+FFFD where the character is unfinished), at every cut."""
    from deltamesh.engine.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer(DEFAULT_MODEL)
    prompt = tok.encode("Say:")
    out = tok.encode(" Hello 🙂 wörld 中文")
    for cut in range(1, len(out) + 1):
        detok = IncrementalDetokenizer(tok, prompt, stop=[])
        text = "".join(detok.add(t) for t in out[:cut]) + detok.flush()
        assert text == tok.decode(out[:cut]), cut


def test_the_engine_times_each_requests_queue_and_first_token(model_dir):
    """EngineStats (the worker's deltamesh_engine_request_queue_seconds and _time_to_first_token_seconds): every
    request the engine prefills is counted once in each, a preempted one too, its first token after its first
    step; a transferred-in request (first token made elsewhere) in neither."""
    core = EngineCore(EngineConfig(model=model_dir, page_size=4, num_kv_pages=24, max_num_batched_tokens=16))
    reqs = [core.make_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts(6, seed=1))]
    run_all(core, reqs)
    s = core.stats
    assert core.scheduler.num_preemptions > 0  # the small pool makes some start twice
    assert s.queued == s.first_tokens == len(reqs)
    assert 0 < s.queue_seconds < s.first_token_seconds
    assert all(r.arrival_time <= r.scheduled_time < r.first_token_time for r in reqs)

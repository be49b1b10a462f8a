"""Prefix caching (shared KV pages + GDN state checkpoints) is exact: every scenario gives token-for-token the
same outputs with the cache as without it (fp32 on CPU, greedy and seeded sampling), for each model family,
and leaves every pool at its cached baseline (dropping the cache then frees everything)."""

import pytest
import torch
from hf_checkpoints import VOCAB
from idle_pools import assert_idle

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
PAGE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)


def tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


P = tokens(30, 1)  # ends two tokens past a page boundary: its checkpoint is at 28


def core(model_dir, cache: bool, **kw) -> EngineCore:
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_kv_pages", 96)  # small pools: building them is most of a small test's time
    return EngineCore(EngineConfig(model=str(model_dir), page_size=PAGE, prefix_cache=cache, **kw))


def run_waves(engine: EngineCore, waves, params, abort_after=None, after_step=None):
    """Submit each wave's prompts together, the next wave once the previous has finished; returns
    {request id: output ids}. `abort_after`: (request id, step) to abort that request at that step; `after_step`:
    called with the engine after every step."""
    out = {}
    for w, prompts in enumerate(waves):
        ids = [f"w{w}r{i}" for i in range(len(prompts))]
        done = set()

        def sink(o, done=done):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)

        for rid, p in zip(ids, prompts):
            engine.submit(engine.make_request(p, params, rid), sink)
        step = 0
        while len(done) < len(ids):
            engine.dispatch(engine.process_commands())
            engine.dispatch(engine.step())
            if after_step:
                after_step(engine)
            step += 1
            if abort_after and abort_after[1] == step and abort_after[0] in ids:
                engine.abort(abort_after[0])
    return out


def assert_cached_baseline(engine: EngineCore):
    assert not engine.has_work and not engine.requests and engine.prefix_cache is not None
    assert_idle(engine)


def compare(model_dir, waves, params, expect_hit_tokens=None, abort_after=None, **kw):
    ref = run_waves(core(model_dir, False, **kw), waves, params, abort_after)
    engine = core(model_dir, True, **kw)
    got = run_waves(engine, waves, params, abort_after)
    if abort_after:
        ref.pop(abort_after[0]), got.pop(abort_after[0])
    assert got == ref
    if expect_hit_tokens is not None:
        assert engine.stats.prefix_cache_hit_tokens == expect_hit_tokens
    assert_cached_baseline(engine)
    return engine


@pytest.fixture(params=FAMILIES)
def model_dir(request, hf_checkpoints):
    return hf_checkpoints[request.param]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_full_hit(model_dir, params):
    engine = compare(model_dir, [[P], [P]], params, expect_hit_tokens=28)
    # the prompt's checkpoint at 28, and the first request's whole sequence when it ended (the second's is the same)
    assert engine.stats.prefix_cache_hits == 1 and engine.stats.checkpoints_saved == 2


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_hit_ending_between_page_boundaries(model_dir, params):
    # the second prompt shares 30 tokens; the cache serves the 28 up to the checkpoint, the rest is computed
    compare(model_dir, [[P], [P + tokens(9, 2)]], params, expect_hit_tokens=28)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_branch_off_the_middle_of_a_cached_prefix(model_dir, params):
    # checkpoints every 2 pages: the branches at token 18 and 11 start from the ones at 16 and 8
    long = P + tokens(10, 3)
    waves = [[long], [long[:18] + tokens(7, 4)], [long[:11] + tokens(5, 5)]]
    compare(model_dir, waves, params, expect_hit_tokens=16 + 8, state_checkpoint_interval=2)


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_concurrent_requests_sharing_a_prefix(model_dir, params):
    together = [P + tokens(6, 10 + i) for i in range(3)]
    after = [P + tokens(5, 20 + i) for i in range(3)]
    # checkpoints every 2 pages: the shared 30 tokens have one at 24, each whole prompt one at 32
    engine = compare(model_dir, [together, after, [after[0]], [after[1]]], params, state_checkpoint_interval=2)
    assert engine.stats.prefix_cache_hits >= 5  # the third of `together`, admitted a step later, may hit too


def conversation(engine: EngineCore, turns: list[list[int]], params) -> list[list[int]]:
    """Each turn's prompt is the whole conversation so far (prompts and replies) plus the turn's new message."""
    history, replies = [], []
    for _t, message in enumerate(turns):
        history = history + message
        [reply] = run_waves(engine, [[history]], params).values()
        replies.append(reply)
        history = history + reply
    return replies


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_next_turn_of_a_conversation_starts_after_the_previous_reply(model_dir, params):
    # the first turn's sequence ends on a page boundary (7 + 5 computed = 12: a checkpoint), the later ones inside
    # a page (21, 33: tails)
    turns = [tokens(7, 80), tokens(3, 81), tokens(6, 82), tokens(9, 83)]
    ref = conversation(core(model_dir, False), turns, params)
    engine = core(model_dir, True)
    assert conversation(engine, turns, params) == ref
    # each later turn starts where the turn before it stopped computing: its prompt and all but its last reply token
    expected = sum(sum(map(len, turns[:t])) + t * (params.max_tokens - 1) + (t - 1) for t in range(1, len(turns)))
    assert engine.stats.prefix_cache_hits == len(turns) - 1
    assert engine.stats.prefix_cache_hit_tokens == expected
    assert_cached_baseline(engine)


@pytest.mark.slow
def test_conversations_under_a_small_budget_evict_their_tails(model_dir):
    chats = [[tokens(10, 90 + i), tokens(5, 95 + i)] for i in range(4)]
    ref = [conversation(core(model_dir, False), c, GREEDY) for c in chats]
    engine = core(model_dir, True, prefix_cache_pages=10, prefix_cache_checkpoints=2)
    assert [conversation(engine, c, GREEDY) for c in chats] == ref
    assert engine.stats.checkpoints_evicted > 0 and engine.stats.prefix_cache_hits >= 1
    assert_cached_baseline(engine)


def test_eviction_under_a_small_budget(model_dir):
    prompts = [tokens(22, 30 + i) for i in range(4)]
    waves = [[p] for p in prompts] + [[prompts[-1]], [prompts[0]]]
    engine = compare(model_dir, waves, GREEDY, prefix_cache_pages=8, prefix_cache_checkpoints=2)
    assert engine.stats.checkpoints_evicted > 0 and engine.stats.prefix_cache_hits >= 1


def test_allocation_evicts_cached_pages_instead_of_refusing_or_preempting(model_dir):
    prompts = [tokens(38, 40 + i) for i in range(3)]  # 11 pages each with their outputs
    waves = [[p] for p in prompts] + [[prompts[-1]]]
    engine = compare(model_dir, waves, GREEDY, num_kv_pages=16)
    assert engine.scheduler.num_preemptions == 0 and engine.stats.prefix_cache_hits == 1
    reservation = engine.reservations.reserve(16 * PAGE)  # the whole pool: takes every cached page back
    assert engine.prefix_cache.num_pages == 0
    engine.reservations.cancel(reservation)


def test_aborted_request_that_shared_pages(model_dir):
    waves = [[P], [P + tokens(8, 50), P + tokens(3, 51)]]
    compare(model_dir, waves, GREEDY, abort_after=("w1r0", 2))


def test_preempted_request_with_a_shared_prefix(model_dir):
    prompts = [P + tokens(4 + 3 * i, 60 + i) for i in range(4)]
    waves = [[P], prompts]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = run_waves(core(model_dir, False), waves, params)
    engine = core(model_dir, True, num_kv_pages=26)
    assert run_waves(engine, waves, params) == ref
    assert engine.scheduler.num_preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert_cached_baseline(engine)


def test_held_states_may_share_pages_and_release_to_the_baseline(hf_checkpoints):
    engine = core(hf_checkpoints["qwen3_5"], True)
    done = []
    for i, p in enumerate([P, P + tokens(5, 70)]):
        engine.submit(engine.make_request(p, GREEDY, f"h{i}", hold_state=True), done.append)
        while engine.has_work or not engine._commands.empty():
            engine.dispatch(engine.process_commands())
            engine.dispatch(engine.step())
    assert len(engine.held) == 2 and engine.stats.prefix_cache_hits == 1
    shared = set(engine.held.get("h0").pages) & set(engine.held.get("h1").pages)
    assert len(shared) == 7 and engine.held.regions("h1")
    assert engine.held.release("h0") and engine.held.release("h1")
    assert_cached_baseline(engine)


def test_a_new_users_chat_reuses_the_shared_system_prompt():
    """Chat prompts checkpoint the end of their first message (a tail: mid-page), so another user's
    conversation with the same system prompt starts there."""
    from deltamesh.engine import DEFAULT_MODEL
    from deltamesh.engine.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL)
    system = {"role": "system", "content": "You are a careful assistant who answers in short sentences. " * 4}
    prompts = [tok.encode_chat([system, {"role": "user", "content": q}]) for q in ("What is a list?", "Hi!", "Why?")]
    turn_end = prompts[0].index(prompts[0][0], 1)  # where the second message opens
    assert turn_end % 16 and all(p[:turn_end] == prompts[0][:turn_end] for p in prompts)
    waves = [[p] for p in prompts]
    kw = dict(page_size=16, max_num_seqs=4, num_kv_pages=64)
    plain = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), prefix_cache=False, **kw))
    ref = run_waves(plain, waves, GREEDY)
    engine = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), prefix_cache=True, **kw))
    assert run_waves(engine, waves, GREEDY) == ref
    assert engine.stats.prefix_cache_hit_tokens == 2 * turn_end
    # no stop: chat prompts finishing here skip their last boundary, and each takes its turn end (mid-page, a
    # tail) in passing
    assert engine.stats.steps == plain.stats.steps
    assert_cached_baseline(engine)


def test_memory_pressure_evicts_tails_of_short_sequences_too(hf_checkpoints):
    """A sequence shorter than a page leaves only a tail (no block above it): allocation must be able to take
    its page back like any cached page."""
    engine = core(hf_checkpoints["qwen3_5"], True, num_kv_pages=16)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    run_waves(engine, [[tokens(2, 100 + i)] for i in range(4)], params)  # 2 + 1 tokens: tails of 2 tokens
    assert engine.prefix_cache.num_pages == 4 == engine.prefix_cache.reclaimable()
    reservation = engine.reservations.reserve(16 * PAGE)  # the whole pool
    assert engine.prefix_cache.num_pages == 0
    engine.reservations.cancel(reservation)


def test_a_full_cache_sorts_its_eviction_order_once_per_batch_not_per_page(hf_checkpoints):
    """Once the cache holds every page the pool does not use, each new page a request needs (a page every
    PAGE tokens of decode) evicts: the eviction order is sorted once per batch of 1/64 of the cache's pages (the
    eviction frees that many more than it needs), not for every page. Outputs stay those without the cache."""
    waves = [[tokens(20, 100 + 8 * w + i) for i in range(8)] for w in range(12)]  # ~1,200 pages through 640
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = run_waves(core(hf_checkpoints["qwen3_5"], False, num_kv_pages=640), waves, params)
    engine = core(hf_checkpoints["qwen3_5"], True, num_kv_pages=640)
    cache, calls = engine.prefix_cache, {"sorts": 0, "holds": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    cache.entries.eviction_order = counted("sorts", cache.entries.eviction_order)
    cache.entries._hold = counted("holds", cache.entries._hold)
    assert run_waves(engine, waves, params) == ref
    evicted = calls["holds"] - cache.num_pages
    assert evicted > 30 * cache.entries.slack, calls  # the cache filled, then kept evicting
    assert calls["sorts"] <= evicted // cache.entries.slack + len(waves), (calls, evicted)
    assert_cached_baseline(engine)


@pytest.mark.parametrize("budget", [16, 26], ids=["head-12", "head-2"])
def test_a_state_taken_in_passing_equals_a_chunk_stopped_there(model_dir, budget):
    """The last chunk runs past the prompt's checkpoint (28) to its end and keeps the state there on the way:
    the checkpoint is that of a chunk that stops at 28 (a head of 12 tokens, and of two, shorter than the conv's
    history), and the prompt takes one step fewer. Equal up to float32 rounding: the tokens before 28 went
    through the projections in batches of other sizes, which BLAS may sum in another order."""
    engines = []
    for snapshots in (True, False):
        engine = core(model_dir, True, max_num_batched_tokens=budget)
        engine.scheduler.snapshots = snapshots
        run_waves(engine, [[P]], GREEDY)
        engines.append(engine)
    passing, stopped = engines
    assert passing.stats.checkpoints_saved == stopped.stats.checkpoints_saved == 2
    assert passing.stats.steps == stopped.stats.steps - 1
    # the prompt's checkpoint is the one on a block (the finished sequence's is a tail)
    [a], [b] = (
        [blk.checkpoint for blk in e.prefix_cache.entries.blocks.values() if blk.checkpoint is not None]
        for e in engines
    )
    ca, cb = passing.prefix_cache.checkpoints, stopped.prefix_cache.checkpoints
    for x, y in ((ca.conv[a], cb.conv[b]), (ca.recurrent[a], cb.recurrent[b])):
        assert x.abs().max() > 0.1 and torch.allclose(x, y, rtol=0, atol=1e-5)


def test_a_one_token_head_stops_at_the_checkpoint(hf_checkpoints):
    """A chunk that would reach the checkpoint one token after its start (budget 27: 27, then 28-30) stops there
    as before: a 1-token piece never goes to the GDN prefill kernels."""
    steps = []
    for snapshots in (True, False):
        engine = core(hf_checkpoints["qwen3_5"], True, max_num_batched_tokens=27)
        engine.scheduler.snapshots = snapshots
        run_waves(engine, [[P]], GREEDY)
        steps.append(engine.stats.steps)
    assert steps[0] == steps[1]


@pytest.mark.parametrize("max_seqs", [8, 3], ids=["free-slots", "scratch-only"])
def test_several_states_taken_in_passing_in_one_step(model_dir, max_seqs):
    """Three prompts in one step, each running past its checkpoint (28) to its end: each keeps its state there in
    a snapshot slot of its own (the scratch slot, then free state slots) and the step runs their tails after
    everything else. The checkpoints equal those of chunks stopped there, the outputs are the same, and the
    prompts take one step fewer. With no free slot (every slot a request's), only the first takes its state in
    passing and the others run on without their checkpoints (one step fewer all the same); the lent slots are
    given back either way."""
    prompts = [tokens(30, seed) for seed in (11, 12, 13)]
    engines, outs = [], []
    for snapshots in (True, False):
        engine = core(model_dir, True, max_num_batched_tokens=96, max_num_seqs=max_seqs)
        engine.scheduler.snapshots = snapshots
        outs.append(run_waves(engine, [prompts], GREEDY))
        engines.append(engine)
    passing, stopped = engines
    assert outs[0] == outs[1]
    assert passing.stats.steps == stopped.stats.steps - 1

    def checkpoints(engine):  # each prompt's checkpoint on its block ending at 28, by that block's tokens
        return {
            blk.tokens: blk.checkpoint
            for blk in engine.prefix_cache.entries.blocks.values()
            if blk.checkpoint is not None
        }

    a, b = checkpoints(passing), checkpoints(stopped)
    assert set(b) == {tuple(p[24:28]) for p in prompts}
    assert set(a) == (set(b) if max_seqs > 3 else {tuple(prompts[0][24:28])})
    ca, cb = passing.prefix_cache.checkpoints, stopped.prefix_cache.checkpoints
    for key in a:
        for x, y in ((ca.conv[a[key]], cb.conv[b[key]]), (ca.recurrent[a[key]], cb.recurrent[b[key]])):
            assert x.abs().max() > 0.1 and torch.allclose(x, y, rtol=0, atol=1e-5)
    for engine in engines:
        assert_cached_baseline(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_request_ended_during_a_launch_is_cached_after_it(family, hf_checkpoints):
    """A request stopped by a stop token has its stop token's decode already launched beside another prompt's
    chunk; the token is read during that launch (EngineCore._take_early), and the request's finished sequence is
    cached only once the launch is queued, and its last output is sent only then; the next turn from the cache gives
    the uncached engine's tokens."""
    model, prompt, other = hf_checkpoints[family], tokens(9, 11), tokens(40, 12)
    ref = run_waves(core(model, False), [[prompt]], SamplingParams(max_tokens=8, temperature=0))["w0r0"]
    stop = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[ref[stop]])
    engine = core(model, True, max_num_batched_tokens=8)  # the other prompt's chunks outlast the first request
    cached_when_it_ended = []
    submit = engine.submit

    def submit_watched(req, sink):
        def watched(out):  # a client that sees its reply end may send the next turn at once: it must be cached
            if out.finished and out.request_id == "w0r0":
                cached_when_it_ended.append(engine.prefix_cache.cached_tokens(prompt + req.output_ids + [1]))
            sink(out)

        submit(req, watched)

    engine.submit = submit_watched
    first = run_waves(engine, [[prompt, other]], params)["w0r0"]
    assert first == ref[: stop + 1] and engine.stats.mixed_steps > stop + 2
    assert cached_when_it_ended[0] >= len(prompt) + stop
    follow = prompt + first + tokens(5, 13)
    assert run_waves(engine, [[follow]], GREEDY)["w0r0"] == run_waves(core(model, False), [[follow]], GREEDY)["w0r0"]
    assert engine.stats.prefix_cache_hit_tokens >= len(prompt) + stop


def test_a_full_batch_still_keeps_each_system_prompts_checkpoint():
    """Three chats with system prompts of their own arrive together at a full batch (three slots: no slot to lend,
    only the scratch slot): the first takes its first message's checkpoint in passing, the others stop there
    rather than skip it, so each system prompt serves the next chat that starts with it."""
    from deltamesh.engine import DEFAULT_MODEL
    from deltamesh.engine.tokenizer import Tokenizer

    tok = Tokenizer(DEFAULT_MODEL)
    systems = [
        {"role": "system", "content": f"You are assistant number {n}, who answers in short sentences. " * 3}
        for n in ("one", "two", "three")
    ]
    first = [tok.encode_chat([s, {"role": "user", "content": "What is a list?"}]) for s in systems]
    later = [tok.encode_chat([s, {"role": "user", "content": "And a tuple?"}]) for s in systems]
    ends = [p.index(p[0], 1) for p in first]
    kw = dict(page_size=16, max_num_seqs=3, num_kv_pages=96, max_num_batched_tokens=512)
    plain = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), prefix_cache=False, **kw))
    ref = run_waves(plain, [first, later], GREEDY)
    engine = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), prefix_cache=True, **kw))
    assert run_waves(engine, [first, later], GREEDY) == ref
    assert engine.stats.prefix_cache_hit_tokens == sum(ends)

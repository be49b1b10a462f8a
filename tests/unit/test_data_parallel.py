"""Data-parallel attention on CPU (gloo, one process per rank): each rank runs its own requests through
attention and GDN and the ranks share the MoE layers' experts (split whole with expert parallelism, else by
columns). Greedy output equals the one-rank engine's token for token and logprobs within 1e-4 (fp32) for the
three families, with requests spread over the ranks, ranks left idle in some steps, and states handed over
between data-parallel and one-rank engines."""

import pytest
from idle_pools import assert_idle
from test_tensor_parallel import assert_same, engine_config, prompts, run

from deltamesh.engine import SamplingParams
from deltamesh.engine.engine import Engine
from deltamesh.engine.parallel import ParallelConfigError, Shard, shard_config
from deltamesh.engine.request import FinishReason

pytestmark = pytest.mark.parallel
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
# A rank's batch holds other requests than the one-rank engine's, so its GEMMs round differently: the one-rank
# engine against itself with one request per step differs by up to 2e-4 in these logprobs (Qwen3-Next).
TOL = 2e-4


def dp_engine(path, dp: int = 2, **kw) -> Engine:
    return Engine(engine_config(path, 1, data_parallel_size=dp, **kw))


def core_dp(path, **kw):
    from deltamesh.engine.core import EngineCore

    return EngineCore(engine_config(path, 1, data_parallel_size=2, enable_expert_parallel=True, **kw))


@pytest.mark.parametrize(
    "family,expert_parallel", [("qwen3_5", False), ("qwen3_5_moe", True), ("qwen3_5_moe", False), ("qwen3_next", True)]
)
def test_two_data_parallel_ranks_match_one(hf_checkpoints, family, expert_parallel):
    path = hf_checkpoints[family]
    with dp_engine(path, enable_expert_parallel=expert_parallel) as e:
        got = e.generate(prompts(), PARAMS)
        ranks = {r.dp_rank for r in e.core.scheduler.running}  # finished: nothing left running
        assert not ranks
        assert_idle(e.core.scheduler.ranks[1])
        one_alone = e.generate(prompts()[:1], PARAMS)  # rank 1 idle in every step
    want = run(path, 1)
    assert_same(got, want, TOL)
    assert_same(one_alone, want[:1], TOL)


def test_requests_spread_over_the_ranks_and_each_rank_uses_its_own_pools(hf_checkpoints):
    from test_tp_handoff import core

    engine = core(hf_checkpoints["qwen3_5_moe"], 1, data_parallel_size=2, enable_expert_parallel=True)
    try:
        for i, p in enumerate(prompts()):
            engine.submit(engine.make_request(p, PARAMS, f"r{i}"), lambda out: None)
        engine.process_commands()
        engine.step()
        ranks = engine.scheduler.ranks
        assert [[r.request_id for r in s.running] for s in ranks] == [["r0", "r2"], ["r1"]]
        assert ranks[1].kv_pool.data.is_meta and ranks[1].kv_pool.num_used == 5  # 37 tokens in pages of 8
        assert engine.loads()["kv_pages_used"] == ranks[0].kv_pool.num_used + 5
        while engine.has_work:
            engine.step()
        assert engine.loads()["kv_pages_used"] == 0 and engine.loads()["state_slots_used"] == 0
    finally:
        engine.close()


def test_states_move_between_data_parallel_and_other_layouts(hf_checkpoints):
    """A data-parallel worker's held states (on either rank) continue on a one-rank engine, and states from a
    tensor-parallel prefill continue on a data-parallel decode worker, as the one-rank engine's tokens."""
    from test_tp_handoff import continued, held_states, one_rank_tokens

    path = hf_checkpoints["qwen3_next"]
    want = one_rank_tokens(path)
    dp = {"data_parallel_size": 2, "enable_expert_parallel": True}
    first, held = held_states(path, 1, **dp)
    assert continued(path, 1, first, held) == want
    first, held = held_states(path, 2)
    assert continued(path, 1, first, held, **dp) == want


def test_layouts_that_do_not_fit_are_refused(hf_checkpoints):
    from deltamesh.engine.config import ModelConfig

    path = hf_checkpoints["qwen3_5_moe"]  # 6 experts
    full = ModelConfig.from_dir(path)
    local = shard_config(full, 2, expert_parallel=True, data_parallel=True)
    assert (
        local.num_attention_heads,
        local.num_key_value_heads,
        local.linear_num_value_heads,
        local.local_experts,
    ) == (full.num_attention_heads, full.num_key_value_heads, full.linear_num_value_heads, (0, 3))
    with pytest.raises(ParallelConfigError, match="into 4 data-parallel ranks: num_experts=6"):
        shard_config(full, 4, expert_parallel=True, data_parallel=True)
    with pytest.raises(ValueError, match="cannot both be above 1"):
        Engine(engine_config(path, 2, data_parallel_size=2))


def test_a_data_parallel_rank_reads_whole_tensors_but_its_share_of_the_experts(hf_checkpoints):
    from safetensors.torch import load_file

    from deltamesh.engine.config import ModelConfig
    from deltamesh.engine.parallel import reads_tensor, shard_tensor

    path = hf_checkpoints["qwen3_5_moe"]
    full, tensors = ModelConfig.from_dir(path), load_file(path / "model.safetensors")
    shard = Shard(2, 1, full, expert_parallel=True, data_parallel=True)
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            assert reads_tensor(name, shard) == (int(name.split(".experts.")[1].split(".")[0]) >= 3)
        elif ".mlp.shared_expert." in name:
            assert shard_tensor(name, t, shard).numel() == t.numel() // 2
        else:
            assert shard_tensor(name, t, shard) is t, name


def test_a_rank_dying_fails_requests_with_the_reason(hf_checkpoints):
    with dp_engine(hf_checkpoints["qwen3_5_moe"], enable_expert_parallel=True) as e:
        e.core.followers.procs[0].kill()
        e.core.followers.procs[0].join()
        done = e.generate(prompts()[:1], SamplingParams(max_tokens=4, temperature=0))
        assert done[0].error and "rank 1 exited" in done[0].error
        assert e.core.failure


def test_prefix_cache_on_each_rank_and_conversations_return_to_their_rank(hf_checkpoints):
    """Each rank caches the prefixes and finished conversations it computed (its copies of state slots and
    pages repeated by the rank before its next step); a conversation's next turn goes to the rank that holds it
    and starts from there. Tokens as the one-rank engine's without a cache."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    path = hf_checkpoints["qwen3_next"]

    def next_turns(replies):
        return [p + c.token_ids + [7, 8, 9] for p, c in zip(prompts(), replies)]

    with dp_engine(path, enable_expert_parallel=True, prefix_cache=True) as e:
        first = e.generate(prompts(), params)
        ranks = e.core.scheduler.ranks
        assert all(s.prefix_cache.num_checkpoints for s in ranks)  # both ranks computed and cached some
        e.generate([[3] * 4, [4] * 4, [5] * 4], params)  # one page each: overwrite the pages the replies ended in
        hits = e.core.stats.prefix_cache_hits
        # in an order that taking ranks in turn would place on the wrong ranks (the first turns went 0, 1, 0)
        order = [1, 0, 2]
        follow_up = e.generate([next_turns(first)[i] for i in order], params)
        follow_up = [follow_up[order.index(i)] for i in range(3)]
        assert e.core.stats.prefix_cache_hits >= hits + len(first)  # every conversation found on its rank
        assert e.core.loads()["prefix_cache_pages"] == sum(s.prefix_cache.num_pages for s in ranks)
    with Engine(engine_config(path, 1)) as e:
        want = e.generate(prompts(), params)
        want_follow_up = e.generate(next_turns(want), params)
    assert [c.token_ids for c in first] == [c.token_ids for c in want]
    assert [c.token_ids for c in follow_up] == [c.token_ids for c in want_follow_up]


def test_each_rank_takes_its_prompts_checkpoints_in_passing(hf_checkpoints):
    """With the cache on, a rank's chunk that reaches its prompt's end keeps the state at the prompt's checkpoint
    in that rank's scratch slot: fewer steps than stopping there, and the same prompts again start from those
    checkpoints on their ranks with the one-rank engine's tokens."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    path = hf_checkpoints["qwen3_5"]
    runs = []
    for snapshots in (True, False):
        with dp_engine(path, prefix_cache=True) as e:
            assert all(rank.snapshots for rank in e.core.scheduler.ranks)  # on by default with the cache
            for rank in e.core.scheduler.ranks:
                rank.snapshots = snapshots
            first = e.generate(prompts(), params)
            steps = e.core.stats.steps
            again = e.generate(prompts(), params)
            runs.append((first, again, steps, e.core.stats.prefix_cache_hits))
    with Engine(engine_config(path, 1)) as e:
        want = [c.token_ids for c in e.generate(prompts(), params)]
    (first, again, steps, hits), (_, _, stopped_steps, stopped_hits) = runs
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == want
    assert steps < stopped_steps and hits == stopped_hits == 2  # the two prompts past a page boundary


def test_preemption_and_aborts_on_every_rank_leave_the_others_exact(hf_checkpoints):
    """Pools too small for the load preempt requests on both ranks (their slots zeroed and refilled through the
    rank's next steps), and requests aborted on both ranks (running or waiting) free their space: the others
    give the one-rank engine's tokens, and every pool of every rank ends empty."""
    from test_engine import run_all
    from test_tp_handoff import core

    path = hf_checkpoints["qwen3_5_moe"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    long_prompts = [p * 2 for p in prompts()] + prompts()  # six requests, three per rank
    small = core(path, 1, data_parallel_size=2, enable_expert_parallel=True, num_kv_pages=20)
    try:
        reqs = [small.make_request(p, params, f"r{i}") for i, p in enumerate(long_prompts)]

        def on_step(step: int) -> None:
            if step == 3:
                assert (reqs[4].dp_rank, reqs[3].dp_rank) == (0, 1)
                small.abort("r4")
                small.abort("r3")

        got, finals = run_all(small, reqs, on_step)
        assert all(s.num_preemptions > 0 for s in small.scheduler.ranks)
        for rank in small.scheduler.ranks:
            assert_idle(rank)
    finally:
        small.close()
    assert finals["r4"].finish_reason == finals["r3"].finish_reason == FinishReason.ABORT
    kept = [0, 1, 2, 5]
    with Engine(engine_config(path, 1, num_kv_pages=256)) as e:
        want = e.generate([long_prompts[i] for i in kept], params)
    assert [got[f"r{i}"] for i in kept] == [c.token_ids for c in want]


def test_states_arrive_through_a_small_area_and_wait_when_it_is_full(hf_checkpoints):
    """A parallel engine receives each state into its arrival area (room for --handoff-states states), not into
    a copy of its pools: with room for one, a second reservation is refused (its rank space given back) until
    the first state has gone to its rank, before the request's first step."""
    from test_tp_handoff import PARAMS as HANDOFF_PARAMS
    from test_tp_handoff import held_states, one_rank_tokens

    from deltamesh.engine.cache import PoolExhausted

    path = hf_checkpoints["qwen3_next"]
    first, held = held_states(path, 1)
    engine = core_dp(path, handoff_states=1)
    try:
        tokens = {}
        for i, prompt in enumerate(prompts()):
            rid = f"r{i}"
            used = engine.loads()["state_slots_used"]
            reservation = engine.reservations.reserve(len(prompt))
            with pytest.raises(PoolExhausted):
                engine.reservations.reserve(len(prompt))
            assert engine.loads()["state_slots_used"] == used + 1  # the refused one's slot given back
            offset = 0
            for region in reservation.regions:
                region.tensor.copy_(held[rid][offset : offset + region.nbytes])
                offset += region.nbytes
            tokens[rid] = list(first[rid])
            engine.submit_transferred(
                engine.make_request(prompt, HANDOFF_PARAMS, rid),
                first[rid][0],
                reservation,
                lambda out, rid=rid: tokens[rid].extend(out.new_token_ids),
            )
            engine.dispatch(engine.process_commands())  # the state goes to its rank: the area is free again
        while engine.has_work:
            engine.dispatch(engine.step())
        assert engine.handoff.area.states.num_used == 0 and engine.loads()["kv_pages_used"] == 0
    finally:
        engine.close()
    want = one_rank_tokens(path)
    assert tokens == {rid: want[rid] for rid in tokens}


def test_held_states_wait_for_room_in_the_handoff_area(hf_checkpoints):
    """A parallel prefill worker holds its states in the hand-off area: with room for one, a second finished
    prefill waits (its first token held back) until the first state is released, and each held state continues
    on a one-rank engine as the one-rank engine's own tokens."""
    import torch
    from test_tp_handoff import PARAMS as HANDOFF_PARAMS
    from test_tp_handoff import continued, one_rank_tokens

    path = hf_checkpoints["qwen3_next"]
    engine = core_dp(path, handoff_states=1)
    outs: dict[str, list] = {}
    first, held = {}, {}
    try:
        for i, p in enumerate(prompts()):
            engine.submit(
                engine.make_request(p, HANDOFF_PARAMS, f"r{i}", hold_state=True),
                lambda out: outs.setdefault(out.request_id, []).append(out),
            )

        def turn() -> None:
            engine.dispatch(engine.process_commands())
            engine.dispatch(engine.step())

        while len(held) < 3:
            for _ in range(20):
                turn()
            done = [rid for rid, o in outs.items() if o[-1].finished and rid not in held]
            assert len(done) == 1 and len(engine.held) == 1  # the others wait for the area
            rid = done[0]
            first[rid] = [t for o in outs[rid] for t in o.new_token_ids]
            held[rid] = torch.cat([r.tensor for r in engine.held.regions(rid)]).clone()
            assert engine.held.release(rid)
        assert engine.loads()["kv_pages_used"] == 0 and engine.handoff.area.states.num_used == 0
    finally:
        engine.close()
    assert continued(path, 1, first, held) == one_rank_tokens(path)


def test_a_prefill_aborted_while_waiting_for_the_area_frees_its_space(hf_checkpoints):
    from test_tp_handoff import PARAMS as HANDOFF_PARAMS

    engine = core_dp(hf_checkpoints["qwen3_next"], handoff_states=1)
    outs: dict[str, list] = {}
    try:
        for i, p in enumerate(prompts()[:2]):
            engine.submit(
                engine.make_request(p, HANDOFF_PARAMS, f"r{i}", hold_state=True),
                lambda out: outs.setdefault(out.request_id, []).append(out),
            )
        for _ in range(20):
            engine.dispatch(engine.process_commands())
            engine.dispatch(engine.step())
        waiting = [r.request_id for r, _ in engine.held.waiting]
        assert len(engine.held) == 1 and len(waiting) == 1 and waiting[0] not in outs
        engine.abort(waiting[0])
        engine.dispatch(engine.process_commands())
        assert outs[waiting[0]][-1].finish_reason == FinishReason.ABORT and not engine.held.waiting
        held = next(rid for rid in outs if rid != waiting[0])
        assert engine.held.release(held)
        assert engine.loads()["kv_pages_used"] == 0 and engine.loads()["state_slots_used"] == 0
        assert engine.handoff.area.states.num_used == 0
    finally:
        engine.close()

"""Request state between engines of different tensor-parallel layouts (CPU, gloo): what each rank holds of a
state is the part its weights compute (checked against the weight-splitting rules), the parts merge back into
the one-rank state, and a state held by an engine of one layout continues on an engine of another token for
token as the one-rank engine's. The transport is left out here (tests/e2e/test_mesh_parallel.py has it)."""

from dataclasses import replace

import pytest
import torch
from hf_checkpoints import write_replicated_kv_checkpoint
from idle_pools import assert_idle
from test_tensor_parallel import engine_config, prompts

from deltamesh.engine import SamplingParams
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.core import EngineCore
from deltamesh.engine.handoff import LayoutMismatch, check_layouts
from deltamesh.engine.parallel import Shard, shard_tensor
from deltamesh.engine.state_shards import RequestState, merge, split

pytestmark = pytest.mark.parallel


def labelled_state(cfg: ModelConfig, pages: int = 2, layers: int = 2) -> RequestState:
    """A one-rank state whose every value names its KV head, conv channel or value head."""
    kv = torch.arange(cfg.num_key_value_heads, dtype=torch.float32)[None, None, None, None, :, None]
    conv = torch.arange(cfg.conv_dim, dtype=torch.float32)[None, :, None]
    recurrent = torch.arange(cfg.linear_num_value_heads, dtype=torch.float32)[None, :, None, None]
    return RequestState(
        kv.expand(pages, layers, 2, 8, -1, cfg.head_dim).clone(),
        conv.expand(layers, -1, cfg.linear_conv_kernel_dim - 1).clone(),
        recurrent.expand(layers, -1, cfg.linear_value_head_dim, cfg.linear_key_head_dim).clone(),
    )


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_holds_the_state_its_weights_compute_and_the_parts_merge_back(tmp_path, ranks):
    cfg = ModelConfig.from_dir(write_replicated_kv_checkpoint(tmp_path))
    if ranks == 4:  # 2 KV heads over 4 ranks, 4 GDN key heads: each head splits in two, KV heads replicated
        cfg = replace(cfg, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
    whole = labelled_state(cfg)
    parts = [split(whole, Shard(ranks, r, cfg)) for r in range(ranks)]
    d = cfg.head_dim
    for r, part in enumerate(parts):
        shard = Shard(ranks, r, cfg)
        # the conv channels a rank's conv1d weight rows compute: q_r | k_r | v_r, not the r-th chunk of q | k | v
        channels = shard_tensor("model.layers.0.linear_attn.conv1d.weight", torch.arange(cfg.conv_dim), shard)
        assert torch.equal(part.conv[0, :, 0], channels.float())
        heads = shard_tensor("model.layers.3.self_attn.k_proj.weight", torch.arange(cfg.num_key_value_heads * d), shard)
        assert torch.equal(part.kv[0, 0, 0, 0, :, 0], (heads[::d] // d).float())
        value_heads = shard_tensor(
            "model.layers.0.linear_attn.dt_bias", torch.arange(cfg.linear_num_value_heads), shard
        )
        assert torch.equal(part.recurrent[0, :, 0, 0], value_heads.float())
    assert parts[0].kv.shape[4] == parts[1].kv.shape[4] == 1  # one KV head each: a copy, with more ranks than heads
    merged = merge(parts, cfg)
    assert all(torch.equal(a, b) for a, b in zip(merged.tensors(), whole.tensors()))


def test_a_sender_layout_that_cannot_hold_the_model_is_refused(hf_checkpoints):
    cfg = ModelConfig.from_dir(hf_checkpoints["qwen3_5_moe"])  # 2 KV heads, 2 GDN key heads
    for sender, receiver in ((1, 2), (2, 1), (2, 2), (1, 1)):
        check_layouts(cfg, sender, receiver)
    with pytest.raises(
        LayoutMismatch,
        match="sender's layout does not fit this model: cannot split this model into 3 tensor-parallel ranks",
    ):
        check_layouts(cfg, 3, 2)
    with pytest.raises(LayoutMismatch, match="linear_num_key_heads=2"):
        check_layouts(cfg, 4, 1)
    with pytest.raises(LayoutMismatch, match="tensor-parallel size 0 is not a layout"):
        check_layouts(cfg, 0, 1)


def core(path, tp: int, **kw) -> EngineCore:
    return EngineCore(engine_config(path, tp, **kw))


PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def run_all(engine: EngineCore, requests) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for r in requests:
        engine.submit(r, lambda out: tokens.setdefault(out.request_id, []).extend(out.new_token_ids))
    while engine.has_work or not engine._commands.empty():
        engine.dispatch(engine.process_commands())
        engine.dispatch(engine.step())
    return tokens


def held_states(path, tp: int, **kw) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """(first tokens, held state's bytes) of each prompt, prefilled on `tp` ranks; the engine closed after (one
    tensor-parallel engine per process)."""
    engine = core(path, tp, **kw)
    try:
        requests = [engine.make_request(p, PARAMS, f"r{i}", hold_state=True) for i, p in enumerate(prompts())]
        first = run_all(engine, requests)
        held = {rid: torch.cat([r.tensor for r in engine.held.regions(rid)]) for rid in first}
        assert all(engine.held.release(rid) for rid in first)
        assert_idle(engine.scheduler)
        return first, held
    finally:
        engine.close()


def continued(path, tp: int, first, held, sender_parts: int = 0, **kw) -> dict[str, list[int]]:
    """Each held state written into a reservation of an engine on `tp` ranks and decoded from its first token;
    `sender_parts`: the states are that many ranks' parts (0: the one-rank layout)."""
    engine = core(path, tp, **kw)
    try:
        tokens = {rid: list(t) for rid, t in first.items()}
        for i, prompt in enumerate(prompts()):
            rid = f"r{i}"
            reservation = engine.reservations.reserve(len(prompt), sender_parts)
            assert sum(r.nbytes for r in reservation.regions) == held[rid].numel()  # the same layout, both
            offset = 0
            for region in reservation.regions:
                region.tensor.copy_(held[rid][offset : offset + region.nbytes])
                offset += region.nbytes
            engine.submit_transferred(
                engine.make_request(prompt, PARAMS, rid),
                first[rid][0],
                reservation,
                lambda out, rid=rid: tokens[rid].extend(out.new_token_ids),
            )
        while engine.has_work or not engine._commands.empty():
            engine.dispatch(engine.process_commands())
            engine.dispatch(engine.step())
        assert_idle(engine.scheduler)
        if sender_parts == tp > 1:  # its own ranks' parts went to them as they came, not through its area
            assert engine.handoff._area is None
        return tokens
    finally:
        engine.close()


def one_rank_tokens(path) -> dict[str, list[int]]:
    engine = core(path, 1)
    try:
        return run_all(engine, [engine.make_request(p, PARAMS, f"r{i}") for i, p in enumerate(prompts())])
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_state_held_on_one_layout_continues_on_another_as_the_one_rank_engine(hf_checkpoints, tmp_path, family):
    path = write_replicated_kv_checkpoint(tmp_path) if family == "qwen3_5" else hf_checkpoints[family]
    want = one_rank_tokens(path)
    ep = {"enable_expert_parallel": True} if family != "qwen3_5" else {}
    first, held = held_states(path, 2, **ep)
    assert continued(path, 1, first, held) == want  # 2 -> 1
    first, held = held_states(path, 1)
    assert continued(path, 2, first, held, **ep) == want  # 1 -> 2


def pulled_where_held(engine: EngineCore, transport, rids: list[str]) -> dict[str, torch.Tensor]:
    """Each held state of `engine` pulled over `transport` (UCX, in this process) as a decode worker would: a
    lease naming its regions where the engine's ranks hold them, a puller that heard of the holder (and so of its
    ranks) reading them."""
    import asyncio

    from deltamesh.engine.cache import Region
    from deltamesh.transfer import LeaseKey, LeaseTable
    from deltamesh.transfer.leases import extent

    async def pull_all() -> dict[str, torch.Tensor]:
        leases, ended = LeaseTable(), []
        holder = transport.holder(leases)
        holder.add_ranks({rank: memory.exported for rank, memory in engine.rank_memory.items()})
        await holder.start()
        puller = transport.puller()
        await puller.start()
        assert puller.announce(holder.describe(engine.held.pool_views()))  # as the router announces a prefill worker
        pulled = {}
        for rid in rids:
            buffers = [r.tensor if isinstance(r, Region) else r for r in engine.held.regions(rid)]
            lease = leases.offer(rid, buffers, 30, ended.append)
            sizes = [extent(b)[1] for b in buffers]
            source = puller.source(holder.offer(lease), LeaseKey(rid, lease.token), sizes)
            pulled[rid] = torch.empty(sum(sizes), dtype=torch.uint8)
            await puller.pull(source, [pulled[rid]], 20)
        for _ in range(200):  # the done notices end the leases
            if len(ended) == len(rids):
                break
            await asyncio.sleep(0.05)
        assert ended == ["pulled"] * len(rids)
        await puller.close()
        await holder.stop()
        return pulled

    return asyncio.run(pull_all())


DP2_EP = {"data_parallel_size": 2, "enable_expert_parallel": True}


@pytest.mark.parametrize("sender", ["tp2", "dp2"])
def test_held_states_are_read_where_the_ranks_hold_them(hf_checkpoints, sender):
    """With a transport that reads other ranks' memory (UCX: each follower registers its pools with a UCX worker
    of its own), a parallel engine offers each held state where its ranks keep it, nothing through rank 0's
    hand-off area: a tensor-parallel one as every rank's part (its KV heads, conv channels, value heads), which
    a receiver of the same layout hands its ranks as they are and any other merges; a data-parallel one whole,
    from the rank that computed it. Pulled over UCX from the
    follower processes, each state continues on a one-rank and on a two-rank engine as the one-rank engine's own
    tokens (Qwen3-Next, fp32)."""
    from deltamesh.transfer.ucx import UcxTransport

    path = hf_checkpoints["qwen3_next"]
    transport = UcxTransport()  # first: the followers inherit the UCX settings it makes
    tp, kw = (2, {}) if sender == "tp2" else (1, DP2_EP)
    engine = core(path, tp, rank_exporter=UcxTransport.rank_exporter, **kw)
    try:
        requests = [engine.make_request(p, PARAMS, f"r{i}", hold_state=True) for i, p in enumerate(prompts())]
        first = run_all(engine, requests)
        if sender == "dp2":
            assert sorted({engine.held.get(rid).dp_rank for rid in first}) == [0, 1]
        held = pulled_where_held(engine, transport, list(first))
        assert engine.handoff._area is None  # never made: no state went through rank 0
        assert all(engine.held.release(rid) for rid in first)
        assert_idle(engine.scheduler)
    finally:
        engine.close()
        transport.close()
    parts = 2 if sender == "tp2" else 0
    want = one_rank_tokens(path)
    assert continued(path, 1, first, held, parts) == want
    assert continued(path, 2, first, held, parts) == want

"""Tensor parallelism on CPU (gloo, one process per rank): an engine split over 2 or 4 ranks gives the one-rank
engine's greedy output token for token and its logprobs within 1e-4 (fp32), for the three families, on
checkpoints written by transformers; and the rules that split the weights."""

import json

import pytest
import torch
from hf_checkpoints import VOCAB, randomize

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine import Engine
from deltamesh.engine.parallel import ParallelConfigError, Shard, shard_config, shard_tensor

pytestmark = pytest.mark.parallel
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def engine_config(path, tp: int, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        tensor_parallel_size=tp,
        torch_threads=1,
        **kw,
    )


def engine(path, tp: int, **kw) -> Engine:
    return Engine(engine_config(path, tp, **kw))


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 37, 61)]


PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
# this file's own runs also compare prompt logprobs (their rows cross the ranks' vocabulary gather too); data
# parallel refuses them, so the callers that import `run` keep PARAMS
WITH_PROMPT = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def run(path, tp: int, params: SamplingParams = PARAMS, **kw):
    with engine(path, tp, **kw) as e:
        return e.generate(prompts(), params)


def assert_same(got, want, tol: float = 1e-4):
    for g, w in zip(got, want):
        assert g.error is None and g.token_ids == w.token_ids
        assert len(g.prompt_logprobs or []) == len(w.prompt_logprobs or [])
        for a, b in zip(g.logprobs + (g.prompt_logprobs or []), w.logprobs + (w.prompt_logprobs or [])):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= tol and a.rank == b.rank
            assert all(abs(x[1] - y[1]) <= tol for x, y in zip(a.top, b.top))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one(hf_checkpoints, family):
    path = hf_checkpoints[family]
    assert_same(run(path, 2, WITH_PROMPT), run(path, 1, WITH_PROMPT))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_expert_parallel_ranks_match_one(hf_checkpoints, family):
    """Two ranks, each with half the routed experts whole (the shared expert and the rest split by columns)."""
    path = hf_checkpoints[family]
    with engine(path, 2, enable_expert_parallel=True) as e:
        assert e.core.model.layers[1].mlp.w13.shape[0] == 3  # of 6 experts
        got = e.generate(prompts(), WITH_PROMPT)
    assert_same(got, run(path, 1, WITH_PROMPT))


def _checkpoint_for_four_ranks(tmp_path, family):
    """Head counts that four ranks split non-trivially: 2 KV heads for 4 query heads (each KV head replicated
    on two ranks), 4 GDN key heads with 2 value heads each."""
    import hf_checkpoints as hc

    common = dict(
        hc._COMMON, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8
    )
    moe = dict(hc._MOE, moe_intermediate_size=32, shared_expert_intermediate_size=24)
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **moe, rope_parameters=hc._MROPE))
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM(
            Qwen3NextConfig(
                **common,
                **moe,
                intermediate_size=64,
                decoder_sparse_step=1,
                mlp_only_layers=[0, 2],
                rope_parameters=hc._ROPE,
            )
        )
    torch.manual_seed(3)
    randomize(model.eval(), 3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_four_ranks_with_replicated_kv_heads_match_one(tmp_path, family):
    path = _checkpoint_for_four_ranks(tmp_path, family)
    want = run(path, 1, WITH_PROMPT)
    assert_same(run(path, 4, WITH_PROMPT), want)
    assert_same(run(path, 2, WITH_PROMPT, enable_expert_parallel=True), want)  # 3 of 6 experts per rank


def test_prefix_cache_state_copies_reach_every_rank(hf_checkpoints):
    """The prefix cache restores GDN state by copying slots (and a conversation's partial last page) outside
    model steps: the followers repeat those copies (a second round of the same prompts starts from cached state
    on every rank, and so does each conversation's next turn, from the end of its reply)."""
    path = hf_checkpoints["qwen3_5"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)

    def next_turns(replies):
        return [p + c.token_ids + [7, 8, 9] for p, c in zip(prompts(), replies)]

    with engine(path, 2, prefix_cache=True) as e:
        first = e.generate(prompts(), params)
        again = e.generate(prompts(), params)
        assert e.core.stats.prefix_cache_hits >= 2
        e.generate([[3] * 4, [4] * 4, [5] * 4], params)  # one page each: overwrite the pages the replies ended in
        follow_up = e.generate(next_turns(first), params)
        assert e.core.stats.prefix_cache_hits >= 2 + len(first)
    with engine(path, 1) as e:
        want = e.generate(prompts(), params)
        want_follow_up = e.generate(next_turns(want), params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == [c.token_ids for c in want]
    assert_same(follow_up, want_follow_up)


def test_a_model_that_cannot_be_split_is_refused_before_any_rank_starts(hf_checkpoints):
    cfg = ModelConfig.from_dir(hf_checkpoints["qwen3_5_moe"])
    with pytest.raises(ParallelConfigError, match="linear_num_key_heads=2"):
        shard_config(cfg, 4)
    with pytest.raises(ParallelConfigError, match="cannot split this model into 3"):
        Engine(EngineConfig(model=str(hf_checkpoints["qwen3_5_moe"]), tensor_parallel_size=3))


def test_rank_dying_fails_requests_with_the_reason(hf_checkpoints):
    path = hf_checkpoints["qwen3_5"]
    with engine(path, 2) as e:
        e.core.followers.procs[0].kill()
        e.core.followers.procs[0].join()
        done = e.generate(prompts()[:1], SamplingParams(max_tokens=4, temperature=0))
        assert done[0].error and "rank 1 exited" in done[0].error
        assert e.core.failure


def test_shards_put_back_together_give_the_full_tensors(hf_checkpoints):
    """Per-rank slices of every split rule, concatenated along their split, are the checkpoint's tensors."""
    from safetensors.torch import load_file

    path = hf_checkpoints["qwen3_5_moe"]
    cfg = ModelConfig.from_dir(path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    full, parts = tensors[name], [shard_tensor(name, tensors[name], Shard(2, r, cfg)) for r in range(2)]
    kd = cfg.linear_key_dim
    split = [p.split((kd // 2, kd // 2, cfg.linear_value_dim // 2)) for p in parts]
    assert torch.equal(torch.cat([torch.cat([s[i] for s in split]) for i in range(3)]), full)
    # the fused expert layout some checkpoints use splits as the per-expert tensors transformers wrote
    layer, experts = "model.layers.3.mlp.experts", range(cfg.num_experts)
    for r in range(2):
        shard = Shard(2, r, cfg)

        def per_expert(proj):
            return [
                shard_tensor(
                    f"{layer}.{e}.{proj}.weight",
                    tensors[f"{layer}.{e}.{proj}.weight"],
                    shard,
                )
                for e in experts
            ]

        fused = torch.stack(
            [
                torch.cat((tensors[f"{layer}.{e}.gate_proj.weight"], tensors[f"{layer}.{e}.up_proj.weight"]))
                for e in experts
            ]
        )
        want = torch.stack([torch.cat(gu) for gu in zip(per_expert("gate_proj"), per_expert("up_proj"))])
        assert torch.equal(shard_tensor(f"{layer}.gate_up_proj", fused, shard), want)
        down = torch.stack([tensors[f"{layer}.{e}.down_proj.weight"] for e in experts])
        assert torch.equal(shard_tensor(f"{layer}.down_proj", down, shard), torch.stack(per_expert("down_proj")))
    name = "lm_head.weight"
    assert torch.equal(
        torch.cat([shard_tensor(name, tensors[name], Shard(3, r, cfg)) for r in range(3)])[:VOCAB], tensors[name]
    )
    assert json.loads(cfg.to_json())["num_key_value_heads"] == 2


def test_an_expert_parallel_rank_reads_only_its_own_experts(hf_checkpoints, tmp_path):
    """Per-expert tensors (and their FP8 scales) of experts another rank holds are never read from disk."""
    from deltamesh.engine.parallel import reads_tensor
    from deltamesh.engine.weights import iter_checkpoint
    from scripts.write_fp8_checkpoint import write_fp8_checkpoint

    path = write_fp8_checkpoint(hf_checkpoints["qwen3_5_moe"], tmp_path / "fp8", (8, 8))
    cfg = ModelConfig.from_dir(path)
    everything = [n for n, _ in iter_checkpoint(path)]
    for rank in range(2):
        shard = Shard(2, rank, cfg, expert_parallel=True)
        read = [n for n, _ in iter_checkpoint(path, lambda n: reads_tensor(n, shard))]
        # per-expert tensors (the MTP layer's fused [E, ...] experts are read whole and sliced on load)
        indices = [n.split(".mlp.experts.")[1].split(".")[0] for n in read if ".mlp.experts." in n]
        experts = {int(i) for i in indices if i.isdigit()}
        assert experts == set(range(3 * rank, 3 * rank + 3))
        assert any(n.endswith("experts.0.gate_proj.weight_scale_inv") for n in read) == (rank == 0)
        assert set(everything) - set(read) == {n for n in everything if ".mlp.experts." in n} - set(read)
    assert all(reads_tensor(n, Shard(2, 1, cfg)) for n in everything)  # tensor parallel alone reads everything


def test_an_fp8_checkpoint_over_two_expert_parallel_ranks_matches_one(hf_checkpoints, tmp_path):
    from scripts.write_fp8_checkpoint import write_fp8_checkpoint

    path = write_fp8_checkpoint(hf_checkpoints["qwen3_next"], tmp_path / "fp8", (8, 8))
    assert_same(run(path, 2, enable_expert_parallel=True), run(path, 1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_parallel_rank_reads_only_its_part_of_each_tensor(hf_checkpoints, family):
    """A rank's weights loaded from safetensors slices of its parts equal those of every tensor read whole and
    split; it reads a fraction of the checkpoint (Qwen3-Next's fused GDN projections, regrouped on load, whole)."""
    from deltamesh.engine.parallel import TensorParallelGroup
    from deltamesh.engine.weights import build_model, iter_checkpoint, load_checkpoint, load_tensors

    path = hf_checkpoints[family]
    cfg = ModelConfig.from_dir(path)
    total = sum(t.numel() for _, t in iter_checkpoint(path))
    shards = [Shard(2, 1, cfg)]
    if cfg.num_experts:
        shards += [Shard(2, 1, cfg, expert_parallel=True), Shard(2, 1, cfg, expert_parallel=True, data_parallel=True)]
    for shard in shards:
        group = TensorParallelGroup(shard)
        sliced, whole = (build_model(cfg, torch.device("cpu"), torch.float32, group) for _ in range(2))
        reader = load_checkpoint(sliced, path)
        load_tensors(whole, iter_checkpoint(path))
        for (name, a), b in zip(sliced.state_dict().items(), whole.state_dict().values()):
            assert torch.equal(a, b), (shard, name)
        assert reader.elements <= (0.8 if shard.data_parallel else 0.6) * total, shard  # about half, split two ways

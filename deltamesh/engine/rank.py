"""What one rank of an engine holds on its device: the model (or its tensor-parallel shard), the KV and GDN
state pools, the kernels and the model runner. The engine core builds rank 0's; each tensor-parallel follower
process builds its own (engine/tp_workers.py) from the same settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deltamesh.engine import memory_budget
from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.parallel import TensorParallelGroup
from deltamesh.engine.runner import ModelRunner
from deltamesh.engine.weights import fp8_weights, load_model
from deltamesh.kernels import Kernels, ModelShapes, select_kernels

if TYPE_CHECKING:
    from deltamesh.engine.models import HybridLM
    from deltamesh.engine.spec.drafter import MtpDrafter


@dataclass
class Rank:
    model_config: ModelConfig  # the full model's
    device: torch.device
    dtype: torch.dtype
    state_pool: StatePool
    checkpoint_pool: StatePool | None  # the prefix cache's GDN checkpoints
    kv_pool: KVPagePool
    kernels: Kernels
    runner: ModelRunner
    draft_pool: StatePool | None = None  # speculative decoding: the GDN states after each verified token


def build_rank(
    config: EngineConfig,
    mc: ModelConfig,
    max_model_len: int,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
) -> Rank:
    dtype, state_dtype = config.torch_dtype(), config.torch_state_dtype()
    model = load_model(
        mc,
        Path(config.model),
        device,
        dtype,
        config.load_format,
        config.seed,
        tp,
        fp8_weights(mc, device, dtype, tp, config.quantization),
        mtp=config.speculative_tokens > 0,
    )
    local = tp.shard.local if tp else mc
    # the reduced draft head's rows are gathered now, before the KV pool is sized from the memory left
    drafter = _mtp_drafter(config, model) if config.speculative_tokens else None

    def state_pool(num_slots: int, name: str) -> StatePool:
        pool = StatePool(
            num_slots,
            len(local.linear_layers),
            local.conv_dim,
            local.linear_conv_kernel_dim,
            local.linear_num_value_heads,
            local.linear_key_head_dim,
            local.linear_value_head_dim,
            dtype,
            state_dtype,
            device,
        )
        pool.name = name
        return pool

    k = config.speculative_tokens
    slots = state_pool(config.max_num_seqs, "slots")
    # each slot's states after each of the K + 1 tokens a step verifies (the pool adds its own scratch slot)
    drafts = state_pool(memory_budget.draft_states(config) - 1, "drafts") if k else None
    page_bytes = memory_budget.page_bytes(config, local, dtype)
    checkpoints = None
    if config.prefix_cache:  # allocated before the KV pool, which may size itself from the memory left
        most_pages = memory_budget.most_pages(config, max_model_len)
        num = config.resolved_prefix_cache_checkpoints(slots.slot_bytes, page_bytes, most_pages)
        checkpoints = state_pool(num, "checkpoints")
    # a parallel engine's leader leaves room for the states it hands over (tp_handoff.HandoffArea)
    left_free = _handoff_area_bytes(config, mc, max_model_len, dtype, state_dtype) if tp and tp.shard.rank == 0 else 0
    num_pages = _num_kv_pages(config, local, max_model_len, device, page_bytes, left_free)
    if tp is not None:  # every rank holds the same pages: the fewest any rank has room for
        count = torch.tensor([num_pages], device=device)
        tp.all_reduce(count, min=True)
        num_pages = int(count.item())
    kv_pool = KVPagePool(
        num_pages,
        config.page_size,
        memory_budget.kv_layers(config, local),
        local.num_key_value_heads,
        local.head_dim,
        dtype,
        device,
    )
    shapes = ModelShapes(
        dtype,
        state_dtype,
        local.linear_num_key_heads,
        local.linear_num_value_heads,
        local.linear_key_head_dim,
        local.linear_value_head_dim,
        local.num_attention_heads,
        local.num_key_value_heads,
        local.head_dim,
        config.page_size,
    )
    kernels = select_kernels(device, shapes, config.kernel_backend)
    runner = ModelRunner(model, kv_pool, slots, kernels, device)
    if k:
        from deltamesh.engine.spec.runner import SpecRunner

        runner.spec = SpecRunner(runner, drafts, k, drafter)
    return Rank(mc, device, dtype, slots, checkpoints, kv_pool, kernels, runner, drafts)


def _mtp_drafter(config: EngineConfig, model: HybridLM) -> MtpDrafter:
    from deltamesh.engine.spec.draft_vocab import DraftHead, draft_vocab_ids
    from deltamesh.engine.spec.drafter import MtpDrafter

    if config.speculative_draft_vocab is None:
        return MtpDrafter()
    return MtpDrafter(DraftHead(model, draft_vocab_ids(config.speculative_draft_vocab, model.cfg.vocab_size)))


def _handoff_area_bytes(
    c: EngineConfig, full: ModelConfig, max_model_len: int, dtype: torch.dtype, state_dtype: torch.dtype
) -> int:
    """The memory of a parallel engine's hand-off area: its states at the longest context, one-rank layout."""
    states = min(c.resolved_handoff_states(), c.max_num_seqs)  # as tp_handoff.AreaSize.of (an upper bound)
    pages = memory_budget.request_pages(c, max_model_len)
    state = memory_budget.state_bytes(full, dtype, state_dtype)
    return states * (pages * memory_budget.page_bytes(c, full, dtype) + state)


def _num_kv_pages(
    c: EngineConfig, local: ModelConfig, max_model_len: int, device: torch.device, page_bytes: int, left_free: int
) -> int:
    """The KV pool's pages (memory_budget.kv_pool_pages), the weights and state pools allocated by now; `left_free`:
    bytes of GPU memory the pool must leave free."""
    allocated = None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the weights' loading freed is no part of this worker's use
        allocated = torch.cuda.memory_reserved(device)
    dtype = c.torch_dtype()
    fp = memory_budget.Footprint(
        0,
        0,
        left_free,
        memory_budget.runtime_bytes(c, local, dtype, device.type == "cuda"),
        page_bytes,
        memory_budget.request_pages(c, max_model_len),
    )
    return memory_budget.kv_pool_pages(c, max_model_len, fp, device, allocated)

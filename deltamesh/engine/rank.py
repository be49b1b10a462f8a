"""What one rank of an engine holds on its device: the model (or its tensor-parallel shard), the KV and GDN
state pools, the kernels and the model runner. The engine core builds rank 0's; each tensor-parallel follower
process builds its own (engine/tp_workers.py) from the same settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig
from deltamesh.engine.parallel import TensorParallelGroup
from deltamesh.engine.runner import ModelRunner
from deltamesh.engine.weights import fp8_weights, load_model
from deltamesh.kernels import Kernels, ModelShapes, select_kernels


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
    # each slot's states after each of the K + 1 tokens a step verifies: (slots + 1) * (K + 1) of them
    drafts = state_pool((config.max_num_seqs + 1) * (k + 1) - 1, "drafts") if k else None
    page_bytes = _page_bytes(config, local, dtype)
    checkpoints = None
    if config.prefix_cache:  # allocated before the KV pool, which may size itself from the memory left
        most_pages = _most_kv_pages(config, max_model_len)
        num = config.resolved_prefix_cache_checkpoints(slots.slot_bytes, page_bytes, most_pages)
        checkpoints = state_pool(num, "checkpoints")
    # a parallel engine's leader leaves room for the states it hands over (tp_handoff.HandoffArea)
    left_free = _handoff_area_bytes(config, mc, max_model_len, dtype, state_dtype) if tp and tp.shard.rank == 0 else 0
    num_pages = _num_kv_pages(config, page_bytes, max_model_len, device, left_free)
    if tp is not None:  # every rank holds the same pages: the fewest any rank has room for
        count = torch.tensor([num_pages], device=device)
        tp.all_reduce(count, min=True)
        num_pages = int(count.item())
    kv_pool = KVPagePool(
        num_pages, config.page_size, kv_layers(config, local), local.num_key_value_heads, local.head_dim, dtype, device
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

        runner.spec = SpecRunner(runner, drafts, k)
    return Rank(mc, device, dtype, slots, checkpoints, kv_pool, kernels, runner, drafts)


def kv_layers(c: EngineConfig, model: ModelConfig) -> int:
    """The KV pool's layers: the full-attention layers', then (speculative decoding) the MTP module's."""
    return len(model.full_layers) + (model.mtp_layers if c.speculative_tokens else 0)


def _page_bytes(c: EngineConfig, local: ModelConfig, dtype: torch.dtype) -> int:
    """One KV page's bytes (KVPagePool.page_bytes, known before the pool is made)."""
    per_page = 2 * max(kv_layers(c, local), 1) * c.page_size * local.num_key_value_heads * local.head_dim
    return per_page * torch.tensor([], dtype=dtype).element_size()


def _most_kv_pages(c: EngineConfig, max_model_len: int) -> int:
    """The KV pool's pages when memory does not bound them: those asked for, or every request at its longest."""
    return c.num_kv_pages or c.max_num_seqs * -(-max_model_len // c.page_size)


def _handoff_area_bytes(
    c: EngineConfig, full: ModelConfig, max_model_len: int, dtype: torch.dtype, state_dtype: torch.dtype
) -> int:
    """The memory of a parallel engine's hand-off area: its states at the longest context, one-rank layout."""
    size = lambda t: torch.tensor([], dtype=t).element_size()  # noqa: E731
    layers = max(len(full.linear_layers), 1)
    conv = layers * full.conv_dim * (full.linear_conv_kernel_dim - 1) * size(dtype)
    recurrent = layers * full.linear_num_value_heads * full.linear_value_head_dim * full.linear_key_head_dim
    pages = -(-max_model_len // c.page_size)
    states = min(c.resolved_handoff_states(), c.max_num_seqs)  # as tp_handoff.AreaSize.of (an upper bound)
    return states * (pages * _page_bytes(c, full, dtype) + conv + recurrent * size(state_dtype))


def _num_kv_pages(
    c: EngineConfig, page_bytes: int, max_model_len: int, device: torch.device, left_free: int = 0
) -> int:
    """`left_free`: bytes of GPU memory the pool sized from what is free must leave."""
    if c.num_kv_pages:
        return c.num_kv_pages
    if c.kv_cache_memory_gb is not None:
        budget = c.kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        budget = 0.85 * torch.cuda.mem_get_info(device)[0] - left_free
    else:
        budget = 2**30
    return max(1, min(_most_kv_pages(c, max_model_len), int(budget // page_bytes)))

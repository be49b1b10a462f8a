"""How much memory a worker's KV pool gets, and whether the worker's budget can serve at all.

The KV pool is sized (engine/rank.py, once the weights and the GDN state pools are allocated) by the first of:

- `--num-kv-pages N`: N pages; `--kv-cache-memory-gb G`: G GiB of pages;
- `--gpu-memory-utilization F` (vLLM's meaning): this worker may use F of the GPU's total memory, weights included,
  so that workers sharing a GPU each take their own fraction. The pool gets what is left of that share after what
  the worker has allocated (weights, state slots, prefix-cache checkpoints: measured) and its runtime reserve;
- otherwise 85 % of the GPU memory free at that moment (whoever else uses it), or 1 GiB on the CPU.

In each case the pool holds at most what `--max-num-seqs` requests at `--max-model-len` need, and a pool sized from
memory that cannot hold one request at `--max-model-len` is an error (MemoryBudgetError, one line naming the flag and
what would fit). With F, a pool given in pages or GiB must fit the share too.

The runtime reserve is what a worker uses beside its weights and pools: the activations of its largest step (and of
the piecewise CUDA graphs' own memory pool), the sampler's logits, the CUDA context and the kernels' workspaces. It is
estimated from the model's widths (`runtime_bytes`), with a 2x margin on the activations, not profiled.

`check_before_start` applies the same arithmetic before a worker loads anything (`deltamesh serve` for each of its
workers, and each worker command): the weights' size is that of the model built on the meta device (exact, nothing
allocated), so a budget that cannot serve fails at once rather than after a model load."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.engine_config import EngineConfig

GIB = 2**30
CPU_KV_BYTES = GIB  # the CPU pool without a budget
FREE_FRACTION = 0.85  # of the free GPU memory, for a pool without a budget
CONTEXT_BYTES = 3 * GIB // 2  # CUDA context, cuBLAS / FlashInfer / Triton workspaces and modules


class MemoryBudgetError(ValueError):
    """A worker's memory budget cannot hold its weights, pools and one request at --max-model-len."""


def _size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def kv_layers(c: EngineConfig, mc: ModelConfig) -> int:
    """The KV pool's layers: the full-attention layers', then (speculative decoding) the MTP module's."""
    return len(mc.full_layers) + (mc.mtp_layers if c.speculative_tokens else 0)


def page_bytes(c: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> int:
    """One KV page's bytes (KVPagePool.page_bytes, known before the pool is made); `mc`: the rank's shard."""
    return 2 * max(kv_layers(c, mc), 1) * c.page_size * mc.num_key_value_heads * mc.head_dim * _size(dtype)


def draft_states(c: EngineConfig) -> int:
    """Speculative decoding's draft state pool (rank.py): each slot's states after each of the K + 1 tokens a step
    verifies, the scratch slot's included."""
    k = c.speculative_tokens
    return (c.max_num_seqs + 1) * (k + 1) if k else 0


def state_bytes(mc: ModelConfig, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    """One request's GDN state: conv (model dtype) and recurrent (state dtype) over the linear layers
    (StatePool.slot_bytes, known before the pool is made)."""
    layers = max(len(mc.linear_layers), 1)
    conv = layers * mc.conv_dim * (mc.linear_conv_kernel_dim - 1) * _size(dtype)
    recurrent = layers * mc.linear_num_value_heads * mc.linear_value_head_dim * mc.linear_key_head_dim
    return conv + recurrent * _size(state_dtype)


def request_pages(c: EngineConfig, max_model_len: int) -> int:
    """KV pages of one request at the longest context."""
    return -(-max_model_len // c.page_size)


def most_pages(c: EngineConfig, max_model_len: int) -> int:
    """The KV pool's pages when memory does not bound them: those asked for, or every request at its longest."""
    return c.num_kv_pages or c.max_num_seqs * request_pages(c, max_model_len)


def runtime_bytes(c: EngineConfig, mc: ModelConfig, dtype: torch.dtype, cuda: bool) -> int:
    """The runtime reserve (see the module's docstring). Per token of a step: the residual stream, its normed copy
    and the layer's outputs (4 x hidden), the widest projection (attention q with its gate, k, v; or GDN's q, k, v,
    z, b, a), the MLP's gate, up and product (3 x intermediate; an MoE layer's per routed expert, with its output,
    and its shared expert), twice over; and the chunked GDN's per-chunk states (fp32, one per 64 tokens)."""
    dense = 3 * mc.intermediate_size
    moe = mc.num_experts_per_tok * (3 * mc.moe_intermediate_size + mc.hidden_size)
    moe += 3 * mc.shared_expert_intermediate_size
    attention = 2 * mc.num_attention_heads * mc.head_dim + 2 * mc.num_key_value_heads * mc.head_dim
    gdn = mc.conv_dim + mc.linear_value_dim + 2 * mc.linear_num_value_heads
    per_token = 2 * _size(dtype) * (4 * mc.hidden_size + max(dense, moe) + max(attention, gdn))
    per_token += 4 * mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim // 64
    tokens = c.resolved_max_num_batched_tokens()
    if cuda and c.cuda_graphs:
        tokens += c.resolved_piecewise_max_tokens()  # the piecewise graphs keep their own memory pool
    logits = 3 * 4 * c.max_num_seqs * mc.vocab_size  # fp32 logits, probabilities and the top-p sort
    return (CONTEXT_BYTES if cuda else 0) + tokens * per_token + logits


@dataclass(frozen=True)
class Footprint:
    """What one rank holds besides its KV pool, and one request's KV: the parts a budget must hold."""

    weights: int
    states: int  # state slots, prefix-cache checkpoints and draft states (each pool with its scratch slot)
    apart: int  # memory left free beside the pool (a parallel leader's hand-off area)
    runtime: int
    page_bytes: int
    request_pages: int

    @property
    def request_kv(self) -> int:
        return self.request_pages * self.page_bytes

    def parts(self, allocated: int | None) -> list[str]:
        """What the budget holds besides the KV pool, in words (`allocated`: weights and pools as measured)."""
        if allocated is None:
            held = [f"weights {_gib(self.weights)}", f"GDN state pools {_gib(self.states)}"]
        else:
            held = [f"weights and state pools {_gib(allocated)} (allocated)"]
        if self.apart:
            held.append(f"hand-off area {_gib(self.apart)}")
        return [*held, f"runtime reserve {_gib(self.runtime)}"]


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def kv_pool_pages(
    c: EngineConfig, max_model_len: int, fp: Footprint, device: torch.device, allocated: int | None = None
) -> int:
    """The KV pool's pages on `device` (see the module's docstring). `allocated`: bytes this rank has allocated on
    its GPU (weights and state pools), measured; before anything is loaded, `fp.weights` and `fp.states` stand in."""
    if device.type != "cuda":
        return size_kv_pool(c, max_model_len, fp)
    total = torch.cuda.get_device_properties(device).total_memory  # no CUDA context needed (serve's own check)
    sized_from_free = c.gpu_memory_utilization is None and c.kv_cache_memory_gb is None and not c.num_kv_pages
    free = torch.cuda.mem_get_info(device)[0] if sized_from_free else None
    return size_kv_pool(c, max_model_len, fp, total, free, allocated)


def size_kv_pool(
    c: EngineConfig,
    max_model_len: int,
    fp: Footprint,
    gpu_total: int | None = None,
    gpu_free: int | None = None,
    allocated: int | None = None,
) -> int:
    """`kv_pool_pages` in bytes: the GPU's total and free memory (None: a CPU), what the rank has allocated."""
    held = fp.weights + fp.states if allocated is None else allocated
    share = None
    if c.gpu_memory_utilization is not None and gpu_total is not None:
        share = int(c.gpu_memory_utilization * gpu_total)
    if c.num_kv_pages:
        pages = c.num_kv_pages
    else:
        if c.kv_cache_memory_gb is not None:
            budget, what = c.kv_cache_memory_gb * GIB, f"--kv-cache-memory-gb {c.kv_cache_memory_gb:g}"
        elif share is not None:
            budget, what = share - held - fp.apart - fp.runtime, None
        elif gpu_total is not None:
            assert gpu_free is not None, "a GPU's free memory comes with its total"
            budget = FREE_FRACTION * gpu_free - fp.apart
            what = f"{FREE_FRACTION:.0%} of the free GPU memory (without --gpu-memory-utilization)"
        else:
            budget, what = CPU_KV_BYTES, "the CPU's default 1 GiB (without --kv-cache-memory-gb)"
        pages = min(most_pages(c, max_model_len), max(0, int(budget // fp.page_bytes)))
        if pages < fp.request_pages and what is not None:
            raise MemoryBudgetError(
                f"{what} holds {pages} KV pages of {c.page_size} tokens; one request at --max-model-len "
                f"{max_model_len} needs {fp.request_pages} ({_gib(fp.request_kv)}): give more, or a shorter "
                "--max-model-len"
            )
    kv = (pages if c.num_kv_pages else max(pages, fp.request_pages)) * fp.page_bytes
    need = held + fp.apart + fp.runtime + kv
    if share is not None and need > share:
        assert gpu_total is not None  # (share is its part)
        kv_part = (
            f"KV pool {_gib(kv)} ({pages} pages)"
            if c.num_kv_pages or c.kv_cache_memory_gb is not None
            else f"KV cache {_gib(kv)} (one request at --max-model-len {max_model_len})"
        )
        raise MemoryBudgetError(
            f"--gpu-memory-utilization {c.gpu_memory_utilization:g} gives this worker {_gib(share)} of the GPU's "
            f"{_gib(gpu_total)}, short of {_gib(need)} ({', '.join([*fp.parts(allocated), kv_part])}): give at "
            f"least {least_fraction(need, gpu_total):.2f}, or lower --max-num-seqs / --max-model-len"
        )
    return pages


def least_fraction(need: int, total: int) -> float:
    """The smallest --gpu-memory-utilization (two decimals) whose share holds `need` bytes."""
    return math.ceil(need / total * 100) / 100


def estimate(c: EngineConfig, mc: ModelConfig, max_model_len: int) -> Footprint:
    """A one-rank worker's footprint before it loads anything: the weights as the model built on the meta device
    holds them (their FP8 layout included), the state pools as they will be allocated."""
    from deltamesh.engine.weights import build_model, fp8_weights

    device = c.torch_device()
    dtype, state_dtype = c.torch_dtype(), c.torch_state_dtype()
    fp8 = fp8_weights(mc, device, dtype, None, c.quantization)
    model = build_model(mc, torch.device("meta"), dtype, None, fp8, mtp=c.speculative_tokens > 0)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if c.speculative_tokens and c.speculative_draft_vocab is not None:  # the reduced draft head's copy of its rows
        from deltamesh.engine.spec.draft_vocab import draft_vocab_ids

        weights += draft_vocab_ids(c.speculative_draft_vocab, mc.vocab_size).numel() * mc.hidden_size * _size(dtype)
    slot, page = state_bytes(mc, dtype, state_dtype), page_bytes(c, mc, dtype)
    slots = c.max_num_seqs + 1 + draft_states(c)
    if c.prefix_cache:
        slots += c.resolved_prefix_cache_checkpoints(slot, page, most_pages(c, max_model_len)) + 1
    runtime = runtime_bytes(c, mc, dtype, device.type == "cuda")
    return Footprint(weights, slots * slot, 0, runtime, page, request_pages(c, max_model_len))


def check_before_start(c: EngineConfig) -> None:
    """Raise MemoryBudgetError when this worker's budget (--gpu-memory-utilization, --kv-cache-memory-gb) cannot
    hold its weights, pools and one request at --max-model-len; nothing is loaded, no GPU memory taken. A worker
    over several ranks is checked by each rank as it sizes its pool (its shard's numbers are known only there)."""
    if (c.gpu_memory_utilization is None and c.kv_cache_memory_gb is None) or c.num_ranks > 1:
        return
    mc = ModelConfig.from_dir(Path(c.model))
    max_model_len = c.resolved_max_model_len(mc.max_position_embeddings)
    kv_pool_pages(c, max_model_len, estimate(c, mc, max_model_len), c.torch_device())

"""Tensor and expert parallelism: which part of the model each of N ranks holds, and the collectives that join
them.

Every rank holds the model of a *shard config*: the full model with 1/N of the attention heads, the GDN key and
value heads (with their conv channels and recurrent state), the MLP and expert intermediate columns; norms,
routers and gates are replicated. With expert parallelism the routed experts are split whole instead (E/N per
rank; each rank adds the pairs routed to its own experts); the shared expert stays split by columns. A layer's mixer and MLP outputs are partial sums that one all-reduce per block
completes. The embedding and LM head are split by vocabulary rows (padded to a multiple of N): a token's
embedding row lives on one rank (the others add zeros), and the logits are gathered.

With data-parallel attention (`Shard.data_parallel`, engine/data_parallel.py) each rank holds everything but the
MoE layers whole and runs its own requests; only the MoE layers are split as above (experts whole with expert
parallelism, else by columns; the shared expert by columns), and they run on every rank's tokens gathered.

Qwen3.5 has 2 KV heads: with N above that, each KV head is replicated on the N / 2 ranks whose query heads use
it (N must then be a multiple of the KV heads). GDN value heads follow their key head (value head j reads key
head j // (HV / HK)), so a rank's key heads and value heads are contiguous ranges of the same fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from deltamesh.engine.config import ModelConfig
from deltamesh.engine.quantization import SCALE_SUFFIX
from deltamesh.kernels.fp8 import BLOCK

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class ParallelConfigError(ValueError):
    """The model cannot be split into the asked number of ranks."""


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, and the model config each rank holds; with `expert_parallel`, the routed experts
    are split whole among the ranks instead of by intermediate columns; with `data_parallel`, only the MoE
    layers are split."""

    size: int
    rank: int
    full: ModelConfig
    expert_parallel: bool = False
    data_parallel: bool = False

    @property
    def local(self) -> ModelConfig:
        return shard_config(self.full, self.size, self.expert_parallel, self.rank, self.data_parallel)

    def experts(self) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds."""
        if not self.expert_parallel:
            return 0, self.full.num_experts
        count = self.full.num_experts // self.size
        return self.rank * count, count

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and LM head on each rank (the last rank's tail is padding)."""
        return self.full.vocab_size if self.data_parallel else -(-self.full.vocab_size // self.size)

    def kv_heads(self) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds."""
        kv, n = self.full.num_key_value_heads, self.size
        if self.data_parallel:
            return 0, kv
        if kv >= n:
            return self.rank * (kv // n), kv // n
        return self.rank // (n // kv), 1


def shard_config(
    cfg: ModelConfig, size: int, expert_parallel: bool = False, rank: int = 0, data_parallel: bool = False
) -> ModelConfig:
    """The config of the model rank `rank` of `size` holds; ParallelConfigError when the model cannot be split so."""
    if size == 1:
        return cfg
    kv = cfg.num_key_value_heads
    needs = {
        "num_attention_heads": cfg.num_attention_heads,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
    }
    if data_parallel:  # only the MoE layers are split
        needs = {k: needs[k] for k in ("moe_intermediate_size", "shared_expert_intermediate_size")}
        kv = size  # KV heads stay whole
    experts = {}
    if expert_parallel:  # whole experts per rank; the shared expert still split by columns
        del needs["moe_intermediate_size"]
        count = cfg.num_experts // size
        experts = {"local_experts": (rank * count, count)}
    bad = [f"{name}={value}" for name, value in needs.items() if value % size]
    if expert_parallel and cfg.num_experts % size:
        bad.append(f"num_experts={cfg.num_experts}")
    if kv % size and size % kv:
        bad.append(f"num_key_value_heads={kv} (neither a multiple nor a divisor of {size})")
    if bad:
        kind = "data-parallel" if data_parallel else "tensor-parallel"
        raise ParallelConfigError(
            f"cannot split this model into {size} {kind} ranks: {', '.join(bad)} not divisible by {size}"
        )
    changes: dict[str, Any] = {} if data_parallel else {"num_key_value_heads": max(kv // size, 1)}
    changes |= {k: v // size for k, v in needs.items()} | experts
    return replace(cfg, **changes)


@dataclass(frozen=True)
class Part:
    """What one rank holds of a tensor: the index ranges `ranges` along `dim`, concatenated, then `pad` zero
    rows. Applied to a tensor, or to a safetensors slice, which reads only those ranges from disk."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad: int = 0

    def covers(self, shape) -> bool:
        return self.ranges == ((0, shape[self.dim]),) and not self.pad

    def take(self, t):
        lead = (slice(None),) * self.dim
        pieces = [t[lead + (slice(a, b),)] for a, b in self.ranges]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)
        return F.pad(out, (0, 0, 0, self.pad)) if self.pad else out


def _chunk(length: int, size: int, rank: int, offset: int = 0) -> tuple[int, int]:
    """Rank `rank`'s range of `size` equal chunks of `length` indices starting at `offset`."""
    n = length // size
    return offset + rank * n, offset + (rank + 1) * n


def reads_tensor(name: str, shard: Shard) -> bool:
    """Whether this rank needs checkpoint tensor `name` at all (any naming, scales included): under expert
    parallelism a per-expert tensor of an expert another rank holds is not even read from disk."""
    if not shard.expert_parallel or ".mlp.experts." not in name:
        return True
    index = name.split(".mlp.experts.")[1].split(".")[0]
    if not index.isdigit():
        return True
    first, count = shard.experts()
    return first <= int(index) < first + count


def shard_part(name: str, shape, shard: Shard) -> Part | None:
    """Which part of checkpoint tensor `name` (canonical name, Qwen3.5 layout, of the full model's `shape`) this
    rank holds; None for a routed expert another rank holds."""
    n, r, c = shard.size, shard.rank, shard.full
    whole = Part(0, ((0, shape[0]),))
    if n == 1 or (shard.data_parallel and not _in_moe_layer(name)):
        return whole
    along = lambda dim: Part(dim, (_chunk(shape[dim], n, r),))  # noqa: E731 - an even split along `dim`
    if shard.expert_parallel and ".mlp.experts." in name:
        first, count = shard.experts()
        index = name.split(".mlp.experts.")[1].split(".")[0]
        if index.isdigit():  # per-expert tensors: whole, on the rank that holds the expert
            return whole if first <= int(index) < first + count else None
        return Part(0, ((first, first + count),))  # the fused [E, ...] layout
    leaf = name.rsplit(".", 2)
    proj = ".".join(leaf[-2:])
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded to vocab_rows on every rank
        rows = shard.vocab_rows
        start, stop = min(r * rows, shape[0]), min((r + 1) * rows, shape[0])
        return Part(0, ((start, stop),), rows - (stop - start))
    if ".self_attn." in name:
        d = c.head_dim
        if proj in ("q_proj.weight", "q_proj.bias"):  # per head: d query rows, then d gate rows
            return along(0)
        if proj in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            first, count = shard.kv_heads()
            return Part(0, ((first * d, (first + count) * d),))
        if proj == "o_proj.weight":
            return along(1)
        if proj == "o_proj.bias":
            raise ParallelConfigError("tensor parallelism does not support an attention output bias")
        return whole  # q_norm, k_norm
    if ".linear_attn." in name:
        if proj in ("in_proj_qkv.weight", "conv1d.weight"):  # q | k | v channels, each split by head
            kd, vd = c.linear_key_dim, c.linear_value_dim
            return Part(0, (_chunk(kd, n, r), _chunk(kd, n, r, kd), _chunk(vd, n, r, 2 * kd)))
        if proj in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight") or name.endswith(("dt_bias", "A_log")):
            return along(0)
        if proj == "out_proj.weight":
            return along(1)
        return whole  # the gated norm's weight (per value-head dim)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):  # dense MLP, shared and per-expert
        return along(0)
    if name.endswith("down_proj.weight"):
        return along(1)
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: this rank's gate rows, then its up rows
        inter = shape[1] // 2
        return Part(1, (_chunk(inter, n, r), _chunk(inter, n, r, inter)))
    if name.endswith("experts.down_proj"):  # [E, H, I]
        return along(2)
    return whole  # norms, the router, the shared expert's gate


def shard_tensor(name: str, t: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor `name` (see `shard_part`); None for a routed expert another rank
    holds; `t` itself when the rank holds all of it."""
    part = shard_part(name, t.shape, shard)
    if part is None or part.covers(t.shape):
        return None if part is None else t
    return part.take(t)


def _in_moe_layer(name: str) -> bool:
    """A tensor of a MoE layer's routed or shared experts (not the router or the shared expert's gate)."""
    return ".mlp.experts." in name or ".mlp.shared_expert." in name


def shard_scales(name: str, scales: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """This rank's block scales `name` (`<weight>_scale_inv`) of an FP8 weight kept in FP8: the weight's own rule
    applied to the scales spread over the weight's elements, then one per block again. The rank's part of the
    weight must be whole blocks (weights.fp8_weights checks)."""
    weight = name.removesuffix(SCALE_SUFFIX)
    if shard.size == 1 or (shard.expert_parallel and ".mlp.experts." in weight):  # whole experts: by index alone
        return shard_tensor(weight, scales, shard)
    spread = scales.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    part = shard_tensor(weight, spread, shard)
    return None if part is None else part[..., ::BLOCK, ::BLOCK].contiguous()


class TensorParallelGroup:
    """The collectives of one tensor-parallel engine, over a torch.distributed process group."""

    def __init__(self, shard: Shard, group: ProcessGroup | None = None):
        self.shard, self.group = shard, group

    def all_reduce(self, x: torch.Tensor, min: bool = False) -> torch.Tensor:
        """The sum (or the minimum) of `x` over the ranks, in place."""
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MIN if min else dist.ReduceOp.SUM, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The leader's (rank 0's) `x`, in place on every rank."""
        import torch.distributed as dist

        dist.broadcast(x, src=0, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings of `ids` from this rank's vocabulary rows, summed over the ranks."""
        local = ids - self.shard.rank * rows.shape[0]
        mine = (local >= 0) & (local < rows.shape[0])
        out = F.embedding(local.clamp(0, rows.shape[0] - 1), rows).masked_fill_(~mine[:, None], 0)
        return self.all_reduce(out)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[ranks, ...]: every rank's `x` (of the same shape), in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.shard.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, V] logits from each rank's [T, vocab_rows] part."""
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.shard.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.shard.full.vocab_size]

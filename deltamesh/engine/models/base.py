"""The decoder stack every family shares; a family file says which MLP each layer has and how its
checkpoint names map onto this stack's weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import FULL_ATTENTION, ModelConfig
from deltamesh.engine.models.layers import (
    FeedForward,
    GatedAttention,
    GatedDeltaNet,
    Mixer,
    ModuleListOf,
    RMSNorm,
    Rotary,
    SparseMoE,
    WeightSlot,
    _param,
)
from deltamesh.engine.parallel import TensorParallelGroup
from deltamesh.engine.quantization import SCALE_SUFFIX
from deltamesh.kernels import Kernels
from deltamesh.kernels.batch import StepBatch
from deltamesh.kernels.fp8 import BLOCK

if TYPE_CHECKING:
    from deltamesh.engine.data_parallel import DataParallelGroup
    from deltamesh.engine.models.mtp import MultiTokenPredictor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: Mixer, mlp: FeedForward):
        super().__init__()
        self.mixer, self.mlp = mixer, mlp
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        mixer_name = "self_attn" if isinstance(self.mixer, GatedAttention) else "linear_attn"
        return (
            self.mixer.weight_slots(f"{prefix}.{mixer_name}")
            | self.mlp.weight_slots(f"{prefix}.mlp")
            | {
                f"{prefix}.input_layernorm.weight": WeightSlot(self.input_norm.weight),
                f"{prefix}.post_attention_layernorm.weight": WeightSlot(self.post_attention_norm.weight),
            }
        )


class HybridLM(nn.Module, ABC):
    """Embedding, interleaved GDN / gated-attention layers, final norm, LM head. With a parallel group, this
    rank's part of them (deltamesh/engine/parallel.py): `cfg` stays the full model's config, the layers are
    built from the shard's. A data-parallel group (engine/data_parallel.py) splits only the MoE layers, which
    run on every rank's tokens. `fp8`: the projections keep an FP8 checkpoint's values and block scales
    (models/layers.py). `mtp`: with the checkpoint's multi-token-prediction module (models/mtp.py), whose
    attention takes the KV pool's layers after the main model's."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
        fp8: bool = False,
        mtp: bool = False,
    ):
        super().__init__()
        self.cfg, self.group, self.fp8 = cfg, tp, fp8  # group: how the loader shards the weights
        data_parallel = tp is not None and tp.shard.data_parallel
        # a data-parallel shard's group is the engine's DataParallelGroup (engine/data_parallel.py builds it)
        self.tp: TensorParallelGroup | None = None if data_parallel else tp
        self.dp: DataParallelGroup | None = cast("DataParallelGroup", tp) if data_parallel else None
        local = tp.shard.local if tp else cfg
        vocab_rows = tp.shard.vocab_rows if tp else cfg.vocab_size
        self.embed = _param(vocab_rows, cfg.hidden_size)
        layers, kv_layer, state_layer = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            mixer: Mixer
            if kind == FULL_ATTENTION:
                mixer = GatedAttention(local, kv_layer, fp8)
                kv_layer += 1
            else:
                mixer = GatedDeltaNet(local, state_layer, fp8)
                state_layer += 1
            layers.append(DecoderLayer(local, mixer, self.make_mlp(local, i)))
        self.layers: ModuleListOf[DecoderLayer] = ModuleListOf(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(vocab_rows, cfg.hidden_size)
        self.rotary = Rotary(cfg, device)
        self.moe_layers = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        self.mtp: MultiTokenPredictor | None = None
        if mtp:
            from deltamesh.engine.models.mtp import MultiTokenPredictor

            # each MTP layer's MLP is the family's for the main layer of the same index, as vLLM builds it
            mlps = [self.make_mlp(local, i) for i in range(cfg.mtp_layers)]
            self.mtp = MultiTokenPredictor(local, kv_layer, mlps, fp8)

    # -- family hooks --------------------------------------------------------------------------------
    @abstractmethod
    def make_mlp(self, cfg: ModelConfig, layer: int) -> FeedForward:
        """The feed-forward block of decoder layer `layer` (FP8 projections when `self.fp8`)."""

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Turn one checkpoint tensor into the (name, tensor) pairs `weight_slots` knows."""
        yield name, tensor

    def regroups(self, name: str) -> bool:
        """Whether `checkpoint_tensors` rearranges tensor `name` (then a parallel rank reads it whole)."""
        return False

    # -- weights ---------------------------------------------------------------------------------------
    def weight_slots(self) -> dict[str, WeightSlot]:
        slots = {"model.embed_tokens.weight": WeightSlot(self.embed), "model.norm.weight": WeightSlot(self.norm.weight)}
        if not self.cfg.tie_word_embeddings:
            slots["lm_head.weight"] = WeightSlot(self.lm_head)
        for i, layer in enumerate(self.layers):
            slots |= layer.weight_slots(f"model.layers.{i}")
        if self.mtp is not None:
            slots |= self.mtp.weight_slots()
        return slots | self._scale_slots(slots)

    def _scale_slots(self, slots: dict[str, WeightSlot]) -> dict[str, WeightSlot]:
        """`<name>_scale_inv` for every checkpoint weight that lands in an FP8 weight: the same rows of its
        scales, counted in blocks."""
        scale_of = {}
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                if name.endswith("_scale"):
                    scale_of[id(getattr(module, name[: -len("_scale")]))] = p
        out = {}
        for name, slot in slots.items():
            scale = scale_of.get(id(slot.param))
            if scale is None:
                continue
            start = stop = None
            if slot.start is not None:
                assert slot.start % BLOCK == 0 and slot.dim == 0, (name, slot.start)  # blocks never straddle parts
                assert slot.stop is not None, name
                start, stop = slot.start // BLOCK, -(-slot.stop // BLOCK)
            out[name + SCALE_SUFFIX] = WeightSlot(scale, start, stop, slot.dim, slot.index)
        return out

    # -- forward -----------------------------------------------------------------------------------------
    # A step runs `head`, then for each layer `mix` (attention or GDN over the step's sequences: what depends on
    # how its tokens split into sequences) and `after_mix` (everything up to the next layer's mix, row by row).
    # cuda_graphs.PiecewiseGraphs replays `head` and each `after_mix` from CUDA graphs and runs the mixes eagerly.
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: StepBatch,
        kv_pool: KVPagePool,
        state_pool: StatePool,
        kernels: Kernels,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step. `between_layers`: host
        work to do after each layer is queued (EngineCore takes the previous step's tokens there)."""
        x, residual = self.head(input_ids, kernels)
        context = self.mix_context(batch, state_pool, residual.dtype)
        for i in range(len(self.layers)):
            mixed = self.mix(i, x, batch, context, kv_pool, state_pool, kernels)
            x, residual = self.after_mix(i, mixed, residual, kernels)
            if between_layers is not None:
                between_layers()
        return x

    def head(self, input_ids: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first layer's normed input, the residual stream): the embedding."""
        residual = self.embed_ids(input_ids)
        return self.layers[0].input_norm(residual, kernels), residual

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.embed(input_ids, self.embed) if self.tp else F.embedding(input_ids, self.embed)

    def mix_context(self, batch: StepBatch, state_pool: StatePool, dtype: torch.dtype) -> tuple:
        """What every layer's mix reads besides its input: the rotary tables and the state pools' rows (of the
        step's sequences, and of its snapshot slots)."""
        snap, verify = batch.snapshot, batch.verify
        kept = state_pool.layer_rows(snap.slots) if snap is not None else None
        drafts = verify.pool.layer_rows(verify.slots.flatten()) if verify is not None else None
        return self.rotary.cos_sin(batch.positions, dtype), state_pool.layer_rows(batch.state_slots), kept, drafts

    def mix(
        self,
        i: int,
        x: torch.Tensor,
        batch: StepBatch,
        context: tuple,
        kv_pool: KVPagePool,
        state_pool: StatePool,
        kernels: Kernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rope, state_rows, snapshot_rows, draft_rows = context
        mixer = self.layers[i].mixer
        if isinstance(mixer, GatedAttention):
            return mixer.mix(x, batch, rope, kv_pool, kernels)
        return mixer.mix(x, batch, state_pool, state_rows, snapshot_rows, kernels, draft_rows)

    def after_mix(
        self, i: int, mixed: tuple[torch.Tensor, torch.Tensor], residual: torch.Tensor, kernels: Kernels
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's output projection and MLP, then the next layer's input norm (the final norm after the last
        layer): (its normed output, the residual stream). Each residual add is fused with the norm that reads it,
        and the post-attention norm with the MLP's first projection (where the backend can, kernels.*_linear)."""
        tp, dp, layer = self.tp, self.dp, self.layers[i]
        h = layer.mixer.output(mixed, kernels)
        if tp:  # each rank's heads gave a partial sum of the output projection
            h = tp.all_reduce(h)
        post = layer.post_attention_norm
        if dp and isinstance(layer.mlp, SparseMoE):  # on every rank's tokens
            x, residual = kernels.add_rms_norm(h, residual, post.weight, post.eps)
            h = dp.moe(layer.mlp, x, kernels)
        else:  # the norm and the MLP's first projection together
            x, residual, projected = kernels.add_rms_norm_linear(
                h, residual, post.weight, post.eps, layer.mlp.input_weight()
            )
            h = layer.mlp.forward_projected(x, projected, kernels)
        if tp:  # likewise each rank's intermediate columns
            h = tp.all_reduce(h)
        norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
        return kernels.add_rms_norm(h, residual, norm.weight, norm.eps)

    def idle(self, kernels: Kernels) -> None:
        """A data-parallel rank with no tokens in a step: its part of each MoE layer for the other ranks' tokens."""
        if not self.moe_layers:
            return
        assert self.dp is not None, "only a data-parallel rank idles"
        nothing = torch.empty((0, self.cfg.hidden_size), dtype=self.embed.dtype, device=self.embed.device)
        for moe in self.moe_layers:
            self.dp.moe(moe, nothing, kernels)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head)
        return (self.tp.gather_vocab(logits) if self.tp else logits).float()

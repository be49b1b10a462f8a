"""Layers shared by the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next families.

Everything runs on a flat batch of tokens ([T, hidden]) described by a `kernels.batch.StepBatch`.
Projections that read the same input are fused into one weight at load time (see `WeightSlot`): the
checkpoint's tensor names map onto row ranges of the fused weights.

With `fp8`, the projections an FP8 checkpoint quantizes keep its e4m3 values, with `<name>_scale` (one float per
128 x 128 block) beside each (`linear_weight` hands both to the kernels as an `Fp8Weight`); the layers it keeps
in full precision (GDN a/b gates, routers) stay in the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, overload

import torch
from torch import nn

from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.config import ModelConfig
from deltamesh.kernels import Kernels
from deltamesh.kernels.batch import StepBatch
from deltamesh.kernels.fp8 import BLOCK, Fp8Weight


@dataclass(frozen=True)
class WeightSlot:
    """Where a checkpoint tensor lands: `param[index]` (all of `param` if index is None), rows
    [start, stop) of dim `dim` of it (all rows if start is None)."""

    param: torch.Tensor
    start: int | None = None
    stop: int | None = None
    dim: int = 0
    index: int | None = None

    def target(self) -> torch.Tensor:
        t = self.param if self.index is None else self.param[self.index]
        if self.start is None:
            return t
        assert self.stop is not None, "a slot with a start has a stop"
        return t.narrow(self.dim, self.start, self.stop - self.start)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _linear_param(module: nn.Module, name: str, *shape: int, fp8: bool = False) -> None:
    """module.<name>: a linear weight [..., out, in]; with fp8, e4m3 values and module.<name>_scale beside it."""
    setattr(
        module, name, nn.Parameter(torch.empty(*shape, dtype=torch.float8_e4m3fn if fp8 else None), requires_grad=False)
    )
    if fp8:
        *lead, rows, cols = shape
        scales = torch.empty(*lead, -(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.float32)
        setattr(module, name + "_scale", nn.Parameter(scales, requires_grad=False))


def linear_weight(module: nn.Module, name: str):
    """module.<name> as the kernels take it: the tensor, or an Fp8Weight when it has block scales."""
    scale = getattr(module, name + "_scale", None)
    weight = getattr(module, name)
    return weight if scale is None else Fp8Weight(weight, scale)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


class ModuleListOf(nn.ModuleList, Generic[ModuleT]):
    """An nn.ModuleList whose modules are all ModuleT: the same container at run time, but type checkers see
    its items as ModuleT where torch types them as plain Modules."""

    if TYPE_CHECKING:

        def __iter__(self) -> Iterator[ModuleT]: ...

        @overload
        def __getitem__(self, idx: slice) -> nn.ModuleList: ...

        @overload
        def __getitem__(self, idx: int) -> ModuleT: ...

        def __getitem__(self, idx: int | slice) -> ModuleT | nn.ModuleList: ...


def _fused_slots(param: torch.Tensor, names_and_rows: list[tuple[str, int]], dim: int = 0) -> dict[str, WeightSlot]:
    slots, start = {}, 0
    for name, rows in names_and_rows:
        slots[name] = WeightSlot(param, start, start + rows, dim)
        start += rows
    assert start == param.shape[dim], (names_and_rows, param.shape)
    return slots


# ---------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), computed in float32 (kernels.rms_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = _param(dim), eps

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm's weight: w * x / rms(x), gated by silu(z), which kernels.gated_norm_linear computes
    with the output projection."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = _param(dim), eps


class Rotary:
    """cos/sin tables of the partial rotary embedding (rotate-half form, applied by kernels.attention_inputs)
    on the first `rotary_dim` dims of each head.

    Qwen3.5's multimodal RoPE gives each frequency one of three position streams (time, height, width),
    interleaved per `mrope_section`. Text tokens carry the same position in all three streams, so for text
    the recomposition is the identity and this is plain RoPE; `cos_sin` accepts [3, T] positions to show it.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device):
        dim = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        self.mrope_section = cfg.mrope_section

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [T, dim/2] or [3, T, dim/2]
        if positions.dim() == 2:
            freqs = self._interleave_mrope(freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _interleave_mrope(self, freqs: torch.Tensor) -> torch.Tensor:
        out = freqs[0].clone()
        section = self.mrope_section or (freqs.shape[-1], 0, 0)
        for stream in (1, 2):  # height, width take every third frequency from offset 1, 2
            idx = slice(stream, section[stream] * 3, 3)
            out[..., idx] = freqs[stream][..., idx]
        return out


# ---------------------------------------------------------------------------------------------------
class GatedAttention(nn.Module):
    """Full softmax attention with an output gate (sigmoid), q/k RMSNorm, partial RoPE, GQA, paged KV."""

    qkv: nn.Parameter  # the linear weights _linear_param sets (and their block scales with FP8)
    o_proj: nn.Parameter

    def __init__(self, cfg: ModelConfig, kv_layer: int, fp8: bool = False):
        super().__init__()
        self.kv_layer = kv_layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_rows, kv_rows = 2 * self.heads * self.head_dim, self.kv_heads * self.head_dim
        _linear_param(self, "qkv", q_rows + 2 * kv_rows, cfg.hidden_size, fp8=fp8)
        self.qkv_bias = _param(q_rows + 2 * kv_rows) if cfg.attention_bias else None
        _linear_param(self, "o_proj", cfg.hidden_size, self.heads * self.head_dim, fp8=fp8)
        self.o_bias = _param(cfg.hidden_size) if cfg.attention_bias else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.splits = (q_rows, kv_rows, kv_rows)
        self.mix_shapes = ((self.heads, self.head_dim),) * 2  # per token, of `mix`'s outputs

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        slots = {f"{n}.weight": s for n, s in _fused_slots(self.qkv, list(zip(names, self.splits))).items()}
        if self.qkv_bias is not None:
            slots |= {f"{n}.bias": s for n, s in _fused_slots(self.qkv_bias, list(zip(names, self.splits))).items()}
        if self.o_bias is not None:  # (set with qkv_bias: cfg.attention_bias)
            slots[f"{prefix}.o_proj.bias"] = WeightSlot(self.o_bias)
        slots[f"{prefix}.o_proj.weight"] = WeightSlot(self.o_proj)
        slots[f"{prefix}.q_norm.weight"] = WeightSlot(self.q_norm.weight)
        slots[f"{prefix}.k_norm.weight"] = WeightSlot(self.k_norm.weight)
        return slots

    def mix(
        self, x: torch.Tensor, batch: StepBatch, rope: tuple, kv_pool: KVPagePool, kernels: Kernels
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output, its gate), each [T, heads, head_dim]: what `output` reads (it gates, then projects)."""
        t, d = x.shape[0], self.head_dim
        qkv = kernels.linear(x, linear_weight(self, "qkv"), self.qkv_bias)
        k_cache, v_cache = kv_pool.layer(self.kv_layer)
        q = kernels.attention_inputs(
            qkv,
            self.heads,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            *rope,
            k_cache,
            v_cache,
            batch.slot_mapping,
        )
        attn = kernels.paged_attention(q, k_cache, v_cache, batch, d**-0.5)
        gate = qkv[:, : self.splits[0]].view(t, self.heads, 2 * d)[..., d:]
        return attn, gate

    def output(self, mixed: tuple[torch.Tensor, torch.Tensor], kernels: Kernels) -> torch.Tensor:
        return kernels.gate_linear(*mixed, linear_weight(self, "o_proj"), self.o_bias)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention: depthwise causal conv1d over q|k|v, then the gated delta rule with
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), then a gated RMSNorm with silu(z)."""

    in_proj: nn.Parameter  # the linear weights _linear_param sets (and their block scales with FP8)
    in_proj_ba: nn.Parameter | None
    out_proj: nn.Parameter

    def __init__(self, cfg: ModelConfig, state_layer: int, fp8: bool = False):
        super().__init__()
        self.state_layer = state_layer
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv_dim, self.value_dim = cfg.conv_dim, cfg.linear_value_dim
        self.mix_shapes = ((self.hv, self.dv),) * 2  # per token, of `mix`'s outputs
        self.splits = (self.conv_dim, self.value_dim, self.hv, self.hv)  # qkv | z | b | a
        if fp8:  # qkv | z in FP8; the b | a gates stay in the model dtype, as the checkpoints keep them
            _linear_param(self, "in_proj", self.conv_dim + self.value_dim, cfg.hidden_size, fp8=True)
            self.in_proj_ba = _param(2 * self.hv, cfg.hidden_size)
        else:
            self.in_proj, self.in_proj_ba = _param(sum(self.splits), cfg.hidden_size), None
        self.conv_weight = _param(self.conv_dim, cfg.linear_conv_kernel_dim)
        # gate parameters stay float32 whatever the model dtype (exact upcast; GPU kernels take them so)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        _linear_param(self, "out_proj", cfg.hidden_size, self.value_dim, fp8=fp8)
        self.activation = cfg.hidden_act

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        names = [f"{prefix}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
        if self.in_proj_ba is None:
            slots = _fused_slots(self.in_proj, list(zip(names, self.splits)))
        else:
            slots = _fused_slots(self.in_proj, list(zip(names[:2], self.splits[:2])))
            slots |= _fused_slots(self.in_proj_ba, list(zip(names[2:], self.splits[2:])))
        slots[f"{prefix}.conv1d.weight"] = WeightSlot(self.conv_weight.view(self.conv_dim, 1, -1))
        slots[f"{prefix}.dt_bias"] = WeightSlot(self.dt_bias)
        slots[f"{prefix}.A_log"] = WeightSlot(self.A_log)
        slots[f"{prefix}.norm.weight"] = WeightSlot(self.norm.weight)
        slots[f"{prefix}.out_proj.weight"] = WeightSlot(self.out_proj)
        return slots

    def mix(
        self,
        x: torch.Tensor,
        batch: StepBatch,
        state_pool: StatePool,
        state_rows: torch.Tensor,
        snapshot_rows: torch.Tensor | None,
        kernels: Kernels,
        draft_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the delta rule's output, z), each [T, HV, DV]: what `output` reads (it norms, gates, projects). state_rows:
        StatePool.layer_rows of the step's slots; snapshot_rows: those of its snapshot slots (batch.snapshot);
        draft_rows: the draft pool's rows of batch.verify's slots.
        With snapshots, the conv and the delta rule run in two passes: every prefill sequence but the tails, then
        each head's state is copied to its snapshot slot, then the tails, which continue from those states. The
        verifying sequences (leading decode rows) keep the state after each of their tokens in the draft pool."""
        t, nd = x.shape[0], batch.num_decode
        verify = batch.verify
        nv = verify.num_tokens if verify is not None else 0
        if self.in_proj_ba is None:
            mixed, z, b, a = kernels.linear(x, self.in_proj).split(self.splits, dim=-1)
        else:  # FP8 qkv|z and the b|a rows kept in the model dtype: one launch where the backend can
            qkvz, ba = kernels.linear(x, [linear_weight(self, "in_proj"), self.in_proj_ba])
            (mixed, z), (b, a) = qkvz.split(self.splits[:2], dim=-1), ba.split(self.splits[2:], dim=-1)
        idx = state_rows[self.state_layer]
        conv_pool, rec_pool = state_pool.conv_flat, state_pool.recurrent_flat
        prefill_lens = batch.query_lens[nd:]
        snap = batch.snapshot
        tails = snap.count if snap is not None else 0
        first = prefill_lens[: len(prefill_lens) - tails]  # the first pass's sequences, then the tails
        cut = t - sum(prefill_lens[len(first) :])  # where the tails' tokens start
        passes = []  # (token rows, lengths, cumulative lengths, state rows) of each prefill pass
        if prefill_lens:  # (a decode-only batch has no prefill_cu_seqlens)
            assert batch.prefill_cu_seqlens is not None, "a batch with prefill rows has their offsets"
            heads_cu = batch.prefill_cu_seqlens[: len(first) + 1]
            passes.append((slice(nd, cut), first, heads_cu, idx[nd : idx.shape[0] - tails]))
        if snap is not None and tails:
            assert snapshot_rows is not None, "a step with snapshots has their slots' rows"
            passes.append((slice(cut, t), prefill_lens[len(first) :], snap.tail_cu_seqlens, idx[-tails:]))
            kept = snapshot_rows[self.state_layer]

        conv_out = []
        if verify is not None and nv:
            assert draft_rows is not None, "a verify step has its draft slots' rows"
            drafts = draft_rows[self.state_layer].view(verify.count, verify.width)
            own_rows = idx[: nv : verify.width]  # each verifying sequence's own state
            pool = verify.pool
            conv_out.append(
                kernels.conv1d_verify(
                    mixed[:nv], conv_pool, own_rows, pool.conv_flat, drafts, self.conv_weight, self.activation
                )
            )
        if nd > nv:
            conv_out.append(
                kernels.conv1d_update(mixed[nv:nd], conv_pool, idx[nv:nd], self.conv_weight, self.activation)
            )
        for i, (rows, lens, cu, seq_idx) in enumerate(passes):
            if i:  # the heads' conv states, before the tails move them on
                conv_pool.index_copy_(0, kept, conv_pool.index_select(0, seq_idx))
            conv_out.append(
                kernels.conv1d_prefill(mixed[rows], lens, cu, conv_pool, seq_idx, self.conv_weight, self.activation)
            )
        mixed = torch.cat(conv_out) if len(conv_out) > 1 else conv_out[0]

        key_dim = self.hk * self.dk
        q, k, v = mixed.split((key_dim, key_dim, self.value_dim), dim=-1)
        q, k, v = q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk), v.view(t, self.hv, self.dv)
        gates = (self.A_log, self.dt_bias)
        core_out = []
        if nv:
            core_out.append(
                kernels.gdn_verify(
                    q[:nv], k[:nv], v[:nv], a[:nv], b[:nv], *gates, rec_pool, own_rows, pool.recurrent_flat, drafts
                )
            )
        if nd > nv:
            rows = slice(nv, nd)
            core_out.append(
                kernels.gdn_decode(q[rows], k[rows], v[rows], a[rows], b[rows], *gates, rec_pool, idx[rows])
            )
        for i, (rows, lens, cu, seq_idx) in enumerate(passes):
            if i:  # the heads' recurrent states
                rec_pool.index_copy_(0, kept, rec_pool.index_select(0, seq_idx))
            core_out.append(
                kernels.gdn_prefill(q[rows], k[rows], v[rows], a[rows], b[rows], *gates, lens, cu, rec_pool, seq_idx)
            )
        core = torch.cat(core_out) if len(core_out) > 1 else core_out[0]
        return core, z.view(t, self.hv, self.dv)

    def output(self, mixed: tuple[torch.Tensor, torch.Tensor], kernels: Kernels) -> torch.Tensor:
        norm = self.norm
        return kernels.gated_norm_linear(*mixed, norm.weight, norm.eps, linear_weight(self, "out_proj"))


# ---------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused. `input_weight` is its first projection's weight,
    which the decoder may compute with the norm before it (`forward_projected` then takes the rest)."""

    gate_up: nn.Parameter  # the linear weights _linear_param sets (and their block scales with FP8)
    down: nn.Parameter

    def __init__(self, hidden: int, inter: int, fp8: bool = False):
        super().__init__()
        self.inter = inter
        _linear_param(self, "gate_up", 2 * inter, hidden, fp8=fp8)
        _linear_param(self, "down", hidden, inter, fp8=fp8)

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        slots = _fused_slots(
            self.gate_up, [(f"{prefix}.gate_proj.weight", self.inter), (f"{prefix}.up_proj.weight", self.inter)]
        )
        slots[f"{prefix}.down_proj.weight"] = WeightSlot(self.down)
        return slots

    def input_weight(self):
        return linear_weight(self, "gate_up")

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return self.forward_projected(x, kernels.linear(x, self.input_weight()), kernels)

    def forward_projected(self, x: torch.Tensor, gate_up: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.linear(kernels.silu_mul(gate_up), linear_weight(self, "down"))


class SparseMoE(nn.Module):
    """Top-k routed experts (softmax router, optional renormalisation) plus a sigmoid-gated shared expert, all in
    one kernels.moe call (so a backend can fuse the shared expert with the routed ones). Its first projection
    (`input_weight`: the router and the shared expert's gate) may come from the norm before it, as in MLP."""

    w13: nn.Parameter  # the experts' linear weights _linear_param sets (and their block scales with FP8)
    w2: nn.Parameter

    def __init__(self, cfg: ModelConfig, fp8: bool = False):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.inter, self.norm_topk = e, cfg.num_experts_per_tok, i, cfg.norm_topk_prob
        # expert parallelism: this rank's experts [first_expert, first_expert + local)
        self.first_expert, local = cfg.local_experts or (0, e)
        self.gates = _param(e + 1, h)  # the router's rows, then the shared expert's gate: one GEMM for both
        _linear_param(self, "w13", local, 2 * i, h, fp8=fp8)  # per expert: gate rows then up rows
        _linear_param(self, "w2", local, h, i, fp8=fp8)
        self.shared = MLP(h, cfg.shared_expert_intermediate_size, fp8)

    @property
    def router(self) -> torch.Tensor:
        return self.gates[: self.num_experts]

    def weight_slots(self, prefix: str) -> dict[str, WeightSlot]:
        e = self.num_experts
        slots = {
            f"{prefix}.gate.weight": WeightSlot(self.gates, 0, e),
            f"{prefix}.experts.gate_up_proj": WeightSlot(self.w13),
            f"{prefix}.experts.down_proj": WeightSlot(self.w2),
            f"{prefix}.shared_expert_gate.weight": WeightSlot(self.gates, e, e + 1),
        }
        for local in range(self.w13.shape[0]):  # per-expert checkpoint layout
            e, i = self.first_expert + local, self.inter
            slots[f"{prefix}.experts.{e}.gate_proj.weight"] = WeightSlot(self.w13, 0, i, index=local)
            slots[f"{prefix}.experts.{e}.up_proj.weight"] = WeightSlot(self.w13, i, 2 * i, index=local)
            slots[f"{prefix}.experts.{e}.down_proj.weight"] = WeightSlot(self.w2, index=local)
        return slots | self.shared.weight_slots(f"{prefix}.shared_expert")

    def input_weight(self) -> torch.Tensor:
        return self.gates

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return self.forward_projected(x, kernels.linear(x, self.gates), kernels)

    def forward_projected(self, x: torch.Tensor, logits: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        e = self.num_experts
        return kernels.moe(
            x,
            logits[:, :e],
            linear_weight(self, "w13"),
            linear_weight(self, "w2"),
            self.top_k,
            self.norm_topk,
            linear_weight(self.shared, "gate_up"),
            linear_weight(self.shared, "down"),
            logits[:, e:],
            first_expert=self.first_expert,
        )


Mixer = GatedAttention | GatedDeltaNet  # a decoder layer's token mixer
FeedForward = MLP | SparseMoE  # a decoder layer's MLP block

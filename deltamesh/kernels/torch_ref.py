"""Reference kernels in plain torch: correct on any device, the CPU default, and what GPU backends are
tested against.

State layouts (shared with the GPU backends):
- GDN recurrent state pool: [P, HV, V, K] ("K-last": row v holds the key-space vector for value dim v),
  float32 or bfloat16; computations always run in float32.
- GDN conv state pool: [P, C, W-1], the last W-1 inputs of the depthwise causal conv.
- KV cache, per layer: [num_pages, page_size, H_kv, D] views (may be strided on the page dimension).
Pools are addressed by index tensors, so kernels read and write request state in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltamesh.kernels.batch import StepBatch
from deltamesh.kernels.fp8 import Fp8Weight, dequantize


# ---------------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------------
def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) in float32: log-decay g = -exp(A_log) * softplus(a + dt_bias) (<= 0), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised, q scaled by K^-1/2, key heads repeated so each serves its value-head group."""
    q, k = _l2norm(q.float()), _l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    groups = num_v_heads // k.shape[-2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=-2)
        k = k.repeat_interleave(groups, dim=-2)
    return q, k


def gdn_decode(
    q: torch.Tensor,  # [B, HK, K]
    k: torch.Tensor,  # [B, HK, K]
    v: torch.Tensor,  # [B, HV, V]
    a: torch.Tensor,  # [B, HV] decay input (before softplus)
    b: torch.Tensor,  # [B, HV] write-strength input (before sigmoid)
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    state_pool: torch.Tensor,  # [P, HV, V, K]
    state_idx: torch.Tensor,  # [B]
) -> torch.Tensor:
    """One recurrent step per sequence; updates the pooled states in place. Returns [B, HV, V].
    Gates arrive raw (a, b, A_log, dt_bias) because fast kernels fuse their activation."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k = _prepare_qk(q, k, v.shape[-2])
    state = state_pool[state_idx].float() * g.float().exp()[..., None, None]
    predicted = (state @ k.unsqueeze(-1)).squeeze(-1)  # what the state already maps k to
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    state = state + delta.unsqueeze(-1) * k.unsqueeze(-2)
    out = (state @ q.unsqueeze(-1)).squeeze(-1)
    state_pool[state_idx] = state.to(state_pool.dtype)
    return out.to(v.dtype)


def gdn_verify(
    q: torch.Tensor,  # [N * W, HK, K]: N sequences of W tokens each, sequence-major
    k: torch.Tensor,  # [N * W, HK, K]
    v: torch.Tensor,  # [N * W, HV, V]
    a: torch.Tensor,  # [N * W, HV]
    b: torch.Tensor,  # [N * W, HV]
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    state_pool: torch.Tensor,  # [P, HV, V, K] read only
    state_idx: torch.Tensor,  # [N] each sequence's state before its first token
    draft_pool: torch.Tensor,  # [P', HV, V, K]
    draft_idx: torch.Tensor,  # [N, W] where the state after each token goes
) -> torch.Tensor:
    """Speculative verification: W recurrent steps per sequence from its pooled state, the state after token j
    written to draft_pool[draft_idx[:, j]] (the pooled state itself is left as it was: the caller commits the
    accepted one). Each step is gdn_decode's arithmetic, the state rounded to the pool dtype between steps as
    decoding one token at a time rounds it. Returns [N * W, HV, V]."""
    n, w = draft_idx.shape
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k = _prepare_qk(q, k, v.shape[-2])
    q, k, vf = (t.view(n, w, *t.shape[1:]) for t in (q, k, v.float()))
    g, beta = g.view(n, w, -1), beta.view(n, w, -1)
    state = state_pool[state_idx].float()
    out = []
    for j in range(w):
        state = state * g[:, j].exp()[..., None, None]
        predicted = (state @ k[:, j].unsqueeze(-1)).squeeze(-1)
        delta = (vf[:, j] - predicted) * beta[:, j].unsqueeze(-1)
        state = state + delta.unsqueeze(-1) * k[:, j].unsqueeze(-2)
        out.append((state @ q[:, j].unsqueeze(-1)).squeeze(-1))
        draft_pool[draft_idx[:, j]] = state = state.to(draft_pool.dtype)
        state = state.float()
    return torch.stack(out, 1).flatten(0, 1).to(v.dtype)


def _pad_by_sequence(x: torch.Tensor, lens: list[int], padded_len: int) -> torch.Tensor:
    """[T, ...] flat tokens -> [N, padded_len, ...] with zeros after each sequence's end."""
    out = x.new_zeros((len(lens), padded_len) + tuple(x.shape[1:]))
    seq, pos = _token_coords(lens, x.device)
    out[seq, pos] = x
    return out


def _token_coords(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lens_t = torch.tensor(lens, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    pos = torch.arange(int(lens_t.sum()), device=device) - starts[seq]
    return seq, pos


def gdn_prefill(
    q: torch.Tensor,  # [T, HK, K]
    k: torch.Tensor,  # [T, HK, K]
    v: torch.Tensor,  # [T, HV, V]
    a: torch.Tensor,  # [T, HV]
    b: torch.Tensor,  # [T, HV]
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    seq_lens: list[int],  # tokens per sequence, summing to T
    cu_seqlens: torch.Tensor | None,  # [N+1] device offsets (for GPU kernels; unused here)
    state_pool: torch.Tensor,  # [P, HV, V, K]
    state_idx: torch.Tensor,  # [N]
    chunk_size: int = 64,
) -> torch.Tensor:
    """Chunked gated delta rule over variable-length sequences, starting from and writing back the pooled
    states. Sequences are zero-padded to whole chunks: a padded token has beta = 0 and g = 0, so it leaves
    the state untouched. Only chunks are looped over, never tokens. Returns [T, HV, V]."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    num_v_heads = v.shape[-2]
    q, k = _prepare_qk(q, k, num_v_heads)
    n_chunks = -(-max(seq_lens) // chunk_size)
    padded = n_chunks * chunk_size

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [N, H, C, cs, d]
        x = _pad_by_sequence(x.float(), seq_lens, padded).transpose(1, 2)
        return x.reshape(x.shape[0], x.shape[1], n_chunks, chunk_size, -1)

    q, k, v_c = to_chunks(q), to_chunks(k), to_chunks(v)
    beta_c = to_chunks(beta.float().unsqueeze(-1)).squeeze(-1)
    decay = to_chunks(g.float().unsqueeze(-1)).squeeze(-1).cumsum(-1)  # cumulative log-decay in chunk

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta_c.unsqueeze(-1)
    # Intra-chunk delta-rule updates collapse into a unit lower-triangular system (the UT transform);
    # solve_triangular(unitriangular=True) reads only its strictly lower part.
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_c * beta_c.unsqueeze(-1), upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]

    state = state_pool[state_idx].float().transpose(-1, -2)  # [N, HV, K, V] for the chunk algebra
    out = torch.empty_like(new_values)
    for c in range(n_chunks):
        v_new = new_values[:, :, c] - k_cum[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    state_pool[state_idx] = state.transpose(-1, -2).to(state_pool.dtype)

    out = out.reshape(out.shape[0], num_v_heads, padded, -1).transpose(1, 2)  # [N, L, HV, V]
    seq, pos = _token_coords(seq_lens, out.device)
    return out[seq, pos].to(v.dtype)


# ---------------------------------------------------------------------------------------------------
# Depthwise causal conv1d (kernel W), with the last W-1 inputs kept as state
# ---------------------------------------------------------------------------------------------------
def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(x) if activation in ("silu", "swish") else x


def conv1d_update(
    x: torch.Tensor,  # [B, C]
    conv_pool: torch.Tensor,  # [P, C, W-1]
    state_idx: torch.Tensor,  # [B]
    weight: torch.Tensor,  # [C, W]
    activation: str | None = "silu",
) -> torch.Tensor:
    window = torch.cat([conv_pool[state_idx], x.unsqueeze(-1).to(conv_pool.dtype)], dim=-1)  # [B, C, W]
    conv_pool[state_idx] = window[..., 1:]
    out = (window.to(weight.dtype) * weight).sum(-1)
    return _activate(out, activation).to(x.dtype)


def conv1d_verify(
    x: torch.Tensor,  # [N * W, C]: N sequences of W tokens each, sequence-major
    conv_pool: torch.Tensor,  # [P, C, W-1] read only
    state_idx: torch.Tensor,  # [N]
    draft_pool: torch.Tensor,  # [P', C, W-1]
    draft_idx: torch.Tensor,  # [N, W] where the window after each token goes
    weight: torch.Tensor,  # [C, kernel]
    activation: str | None = "silu",
) -> torch.Tensor:
    """conv1d_update over each sequence's W tokens in turn, the window after token j written to
    draft_pool[draft_idx[:, j]] (the pooled window is left as it was)."""
    n, w = draft_idx.shape
    window = conv_pool[state_idx]
    xs = x.view(n, w, -1)
    out = []
    for j in range(w):
        full = torch.cat([window, xs[:, j].unsqueeze(-1).to(conv_pool.dtype)], dim=-1)
        window = full[..., 1:]
        draft_pool[draft_idx[:, j]] = window.to(draft_pool.dtype)
        out.append(_activate((full.to(weight.dtype) * weight).sum(-1), activation))
    return torch.stack(out, 1).flatten(0, 1).to(x.dtype)


def conv1d_prefill(
    x: torch.Tensor,  # [T, C]
    seq_lens: list[int],
    cu_seqlens: torch.Tensor | None,  # the sequences' offsets on the device (kernels use them; unused here)
    conv_pool: torch.Tensor,  # [P, C, W-1]
    state_idx: torch.Tensor,  # [N]
    weight: torch.Tensor,  # [C, W]
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal conv over variable-length sequences, each continuing from its pooled state."""
    width = weight.shape[-1]
    hist = width - 1
    padded = _pad_by_sequence(x, seq_lens, max(seq_lens)).transpose(1, 2)  # [N, C, L]
    inputs = torch.cat([conv_pool[state_idx].to(x.dtype), padded], dim=-1)  # [N, C, W-1+L]
    out = F.conv1d(inputs.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])  # [N, C, L]
    # New state: the last W-1 real inputs of each sequence (including the history it started from).
    lens_t = torch.tensor(seq_lens, device=x.device)
    cols = lens_t[:, None] + torch.arange(hist, device=x.device)[None, :]  # [N, W-1]
    conv_pool[state_idx] = torch.gather(inputs, 2, cols[:, None, :].expand(-1, inputs.shape[1], -1)).to(conv_pool.dtype)
    seq, pos = _token_coords(seq_lens, x.device)
    return _activate(out.transpose(1, 2)[seq, pos], activation).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------------
def write_kv(
    k_cache: torch.Tensor,  # [P, page_size, H, D]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    page_size = k_cache.shape[1]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    k_cache[pages, offsets] = k.to(k_cache.dtype)
    v_cache[pages, offsets] = v.to(v_cache.dtype)


def _attend(
    q: torch.Tensor,  # [T, Hq, D] tokens of the sequences in `seqs`
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
    seqs: range,
    scale: float,
) -> torch.Tensor:
    q_lens = [batch.query_lens[i] for i in seqs]
    if batch.decode_lengths_on_device and seqs.stop <= batch.num_decode:  # one query token each
        ctx = (batch.seq_lens[seqs.start : seqs.stop] - 1).tolist()
    else:
        ctx = [batch.context_lens[i] for i in seqs]
    kv_lens = [c + n for c, n in zip(ctx, q_lens)]
    page_size = k_cache.shape[1]
    max_q, max_kv = max(q_lens), max(kv_lens)
    n_pages = -(-max_kv // page_size)
    tables = batch.block_tables[seqs.start : seqs.stop, :n_pages].long().clamp(min=0)
    keys = k_cache[tables].flatten(1, 2)[:, :max_kv]  # [N, max_kv, H, D]
    values = v_cache[tables].flatten(1, 2)[:, :max_kv]
    queries = _pad_by_sequence(q, q_lens, max_q)  # [N, max_q, Hq, D]

    dev = q.device
    q_pos = torch.tensor(ctx, device=dev)[:, None] + torch.arange(max_q, device=dev)[None, :]
    k_pos = torch.arange(max_kv, device=dev)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # causal, which also bounds keys by the sequence end
    mask[:, :, 0] = True  # padded query rows attend somewhere (their output is discarded)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # [N, max_q, Hq, D]
    seq, pos = _token_coords(q_lens, dev)
    return out[seq, pos]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [P, page_size, H, D]
    v_cache: torch.Tensor,
    batch: StepBatch,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context (already written)."""
    nd = batch.num_decode
    parts = []
    if nd:
        parts.append(_attend(q[:nd], k_cache, v_cache, batch, range(0, nd), scale))
    if batch.num_seqs > nd:
        parts.append(_attend(q[nd:], k_cache, v_cache, batch, range(nd, batch.num_seqs), scale))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------------
# Norms and activations (fused into one kernel each on GPU)
# ---------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x / rms(x) * (1 + weight), computed in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add and the next layer's norm."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: weight * x / rms(x), gated by silu(z)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: [T, 2I] (gate | up) -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A plain weight as it is; an Fp8Weight dequantized (the weight its FP8 values stand for)."""
    return dequantize(w, dtype) if isinstance(w, Fp8Weight) else w


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None):
    """x w^T (+ bias); an Fp8Weight is dequantized first (the activations stay unquantized). A list of weights (the
    projections of one input, e.g. an FP8 weight and the plain rows a checkpoint keeps beside it): the list of
    their outputs, no bias (a backend may compute them in one launch)."""
    if isinstance(w, list):
        assert bias is None, "a list of weights takes no bias"
        return [linear(x, part) for part in w]
    return F.linear(x, _dense(w, x.dtype), bias)


# Projections fused with the op before them (a backend may run the op as the projection loads its input).
def gate_linear(x: torch.Tensor, gate: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The attention's output projection of its gated heads: linear(sigmoid_gate(x, gate), w, bias)."""
    return linear(sigmoid_gate(x, gate), w, bias)


def gated_norm_linear(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, w) -> torch.Tensor:
    """GDN's output projection of its normed heads: linear(gated_rms_norm(x, z, ...) as [T, H*D], w)."""
    return linear(gated_rms_norm(x, z, norm_weight, eps).reshape(x.shape[0], -1), w)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, w):
    """(normed, x + residual, linear(normed, w)): add_rms_norm, then the next block's first projection."""
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    return normed, total, linear(normed, w)


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13,
    w2,
    top_k: int,
    norm_topk: bool,
    shared_w13,
    shared_w2,
    shared_gate: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """A MoE layer's output from its router logits: softmax router, top_k experts per token (renormalised when
    `norm_topk`); expert e maps x to silu_mul(x w13[e]^T) w2[e]^T; outputs weighted and summed per token, plus
    the shared expert silu_mul(x shared_w13^T) shared_w2^T weighted by sigmoid(shared_gate). Under expert
    parallelism w13 and w2 hold experts [first_expert, first_expert + len(w13)) only, and only their pairs
    count (the ranks' outputs are summed). Fp8Weights are dequantized first."""
    w13, w2, shared_w13, shared_w2 = (_dense(w, x.dtype) for w in (w13, w2, shared_w13, shared_w2))
    shared = F.linear(silu_mul(F.linear(x, shared_w13)), shared_w2)
    return _routed(x, router_logits, w13, w2, top_k, norm_topk, first_expert) + torch.sigmoid(shared_gate) * shared


def _routed(x, router_logits, w13, w2, top_k: int, norm_topk: bool, first_expert: int = 0) -> torch.Tensor:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype).flatten()
    # (token, choice) pairs by their expert among this rank's, then each used expert runs once on its tokens
    flat = experts.flatten() - first_expert
    mine = None
    if w13.shape[0] != router_logits.shape[-1]:  # expert parallel: the pairs of this rank's experts
        if x.is_cuda:  # no host sync (CUDA graphs): the other pairs stay, weighted 0, on a clamped expert
            weights = weights * ((flat >= 0) & (flat < w13.shape[0]))
            flat = flat.clamp(0, w13.shape[0] - 1)
        else:
            mine = ((flat >= 0) & (flat < w13.shape[0])).nonzero().squeeze(1)
            flat = flat[mine]
    order = torch.argsort(flat, stable=True)
    pairs = order if mine is None else mine[order]
    token_of, pair_weights = pairs // top_k, weights[pairs]
    if x.is_cuda and x.dtype == torch.bfloat16:
        return _grouped_experts(x, flat, token_of, pair_weights, w13, w2)
    out = torch.zeros_like(x)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tokens = token_of[start : start + n]
        y = F.linear(silu_mul(F.linear(x[tokens], w13[e])), w2[e]) * pair_weights[start : start + n, None]
        start += n
        out.index_add_(0, tokens, y)
    return out


def _grouped_experts(x, flat, token_of, pair_weights, w13, w2) -> torch.Tensor:
    """All experts in two grouped GEMMs (CUDA, bf16), no host synchronisation; `token_of` and `pair_weights`
    in expert order."""
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[token_of], w13.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(silu_mul(h), w2.transpose(1, 2), offs=offsets)
    return torch.zeros_like(x).index_add_(0, token_of, y * pair_weights[:, None])


# ---------------------------------------------------------------------------------------------------
# Attention layer inputs and output gate
# ---------------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding (rotate-half form) on the first cos.shape[-1] dims of each head.
    x: [T, H, D]; cos/sin: [T, rotary_dim]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot = rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat((rot, rest), dim=-1)


def attention_inputs(
    qkv: torch.Tensor,  # [T, 2*H*D + 2*Hkv*D]: per query head [q | gate], then k, then v
    heads: int,
    q_weight: torch.Tensor,  # [D] q RMSNorm weight
    k_weight: torch.Tensor,  # [D]
    eps: float,
    cos: torch.Tensor,  # [T, rotary_dim]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [P, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> torch.Tensor:
    """q and k RMS-normed per head and rotated, k and v written into the paged cache. Returns q [T, H, D]."""
    t, dim, kv_heads = qkv.shape[0], k_cache.shape[-1], k_cache.shape[-2]
    q_rows, kv_rows = 2 * heads * dim, kv_heads * dim
    q = qkv[:, :q_rows].view(t, heads, 2 * dim)[..., :dim]
    k = qkv[:, q_rows : q_rows + kv_rows].view(t, kv_heads, dim)
    v = qkv[:, q_rows + kv_rows :].view(t, kv_heads, dim)
    q = rope(rms_norm(q, q_weight, eps), cos, sin)
    k = rope(rms_norm(k, k_weight, eps), cos, sin)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q.contiguous()


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output gate: x * sigmoid(gate), x [T, H, D], gate a [T, H, D] view; returns [T, H*D]."""
    return (x * torch.sigmoid(gate)).reshape(x.shape[0], -1)

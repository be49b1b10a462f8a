"""Which drafted tokens a verify step keeps, on the device (no host synchronisation).

Each verifying request ran its last token x and its drafts d_1..d_K through the target model; row j of its logits
is the target's distribution p_j of the token after x, d_1..d_j (after the logits stage, which counts d_1..d_j as
generated there: penalties.py). Its new tokens are d_1..d_a, then one more, t:

- greedy (temperature 0): a is the length of the drafts' prefix that equals the target's argmax, t = argmax p_a.
  The tokens are exactly those decoding one token at a time gives (the target's own choices).
- sampled: speculative sampling (Leviathan et al. 2023, Chen et al. 2023) with a point-mass draft distribution
  (the drafter proposes its argmax: q_j = delta(d_j)): d_{j+1} is kept with probability p_j(d_{j+1}); at the first
  rejection t is drawn from p_a with d_{a+1} removed (max(p - q, 0), normalised); if every draft is kept, t is
  drawn from p_K. Each output token is then distributed exactly as the target's p (temperature, top-k, top-p and
  min-p applied: `sampling._filter`). A seeded request draws from generators seeded by (seed, output index), as
  sampling.py does: the same tokens for the same settings and schedule, on one engine or split across prefill and
  decode workers.

Then the run is cut at the first token that ends the request as the device can tell (an EOS or stop token id, or
the token budget of max_tokens and the context): the state is never committed past it, and `done` tells the next
step (launched before the host reads this one) to commit only its first input of this request, the ending token,
as a one-token decode step would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deltamesh.engine.sampling import SamplingParams, _filter, _mix, on_device

_NOISE = 0x5DEECE66D  # a second stream of a seeded request: the final token's noise, apart from the kept-or-not draws


@dataclass
class AcceptInputs:
    """What the leader knows on the host of the sampling requests of a step (verifying ones first)."""

    params: list[SamplingParams]
    output_index: list[int]  # outputs each had on the host when launched (pending ones counted)
    stops: np.ndarray  # [R, S] int64 token ids that end each request (-1 pads)
    budget: np.ndarray  # [R] int64 tokens each may still produce as the host counts them


@dataclass
class Accepted:
    """A step's accepted tokens, per sampling request, on the device."""

    tokens: torch.Tensor  # [R, W] int64: its new tokens (the first `counts` of the row; W = 1 without verification)
    counts: torch.Tensor  # [R] int64 new tokens: accepted drafts + 1
    next_tokens: torch.Tensor  # [R] int64 the last new token: the next step's input
    done: torch.Tensor  # [R] bool a new token ends the request
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # chosen [R, W], top values/ids [R, W, k]


def accept(
    logits: torch.Tensor,  # [R, W, V] float32; a row without drafts has its logits at position 0 only
    drafts: torch.Tensor,  # [R, W - 1] int64 the drafted tokens each request verified (any value where it had none)
    num_drafted: list[int],  # [R] drafts each request verified (K, or 0)
    inputs: AcceptInputs,
    delta: torch.Tensor | None,  # [R] outputs each had on the device beyond the host's count (None: none)
    generator: torch.Generator | None = None,
    raw: torch.Tensor | None = None,  # [R, W, V] the logits before the logits stage, for logprobs (None: `logits`)
) -> Accepted:
    r, w, _ = logits.shape
    dev = logits.device
    choice = logits.argmax(-1)  # [R, W] the target's own tokens (greedy)
    keep = torch.zeros((r, w), dtype=torch.bool, device=dev)  # keep[:, j]: draft j+1 accepted
    if w > 1:
        keep[:, :-1] = choice[:, :-1] == drafts
    positions = torch.arange(w, device=dev)
    verified = positions[None, :] < on_device(num_drafted, torch.int64, dev)[:, None]  # [R, W] a draft follows
    padded = F.pad(drafts, (0, 1))  # [R, W]: draft j+1 at position j
    sampled = [i for i, p in enumerate(inputs.params) if not p.greedy]
    if sampled:
        removed = torch.where(verified, padded, -1)  # what a rejection at each position takes out of p
        choice, keep = _speculative_sampling(logits, drafts, removed, choice, keep, sampled, inputs, generator)
    keep &= verified
    accepted = keep.long().cumprod(-1).sum(-1)  # [R] the prefix of kept drafts
    tokens = torch.where(positions[None, :] < accepted[:, None], padded, 0)
    tokens.scatter_(1, accepted[:, None], choice.gather(1, accepted[:, None]))
    # the run ends at the first token that ends the request
    budget = on_device(inputs.budget.tolist(), torch.int64, dev)
    if delta is not None:
        budget = budget - delta
    stops = on_device(inputs.stops.tolist(), torch.int64, dev)
    ends = (tokens[:, :, None] == stops[:, None, :]).any(-1) | (positions[None, :] + 1 >= budget[:, None])
    ends &= positions[None, :] <= accepted[:, None]
    first_end = torch.where(ends, positions[None, :], w).min(-1).values
    accepted = torch.minimum(accepted, first_end)
    counts = accepted + 1
    next_tokens = tokens.gather(1, accepted[:, None]).squeeze(1)
    out = Accepted(tokens, counts, next_tokens, first_end < w)
    want = [i for i, p in enumerate(inputs.params) if p.logprobs is not None]
    if want:
        out.logprobs = _logprobs(logits if raw is None else raw, tokens, want, inputs.params)
    return out


def _speculative_sampling(logits, drafts, removed, choice, keep, rows: list[int], inputs: AcceptInputs, generator):
    """`choice` and `keep` of the sampled requests' rows as speculative sampling decides them (module docstring);
    `removed` [R, W]: the draft a rejection at each position takes out of p (-1: none was verified there)."""
    r, w, v = logits.shape
    dev = logits.device
    params = [inputs.params[i] for i in rows]
    index = on_device(rows, torch.int64, dev)
    probs = _filter(logits[index].flatten(0, 1), [p for p in params for _ in range(w)]).view(len(rows), w, v)
    uniform = torch.rand((len(rows), w), device=dev, generator=generator)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for n, (i, p) in enumerate(zip(rows, params)):
        if p.seed is not None:
            at = inputs.output_index[i]
            uniform[n] = torch.rand(w, device=dev, generator=_generator(p.seed, at, dev))
            noise[n].exponential_(generator=_generator(p.seed ^ _NOISE, at, dev))
    if w > 1:
        p_draft = probs[:, :-1].gather(-1, drafts[index][..., None]).squeeze(-1)
        keep[index, :-1] = uniform[:, :-1] < p_draft
    # where a draft is rejected, the next token comes from p without it; after the last draft, from p
    residual = probs.masked_fill(torch.arange(v, device=dev) == removed[index][..., None], 0.0)
    choice[index] = (residual / noise).argmax(-1)
    return choice, keep


def _generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(_mix(seed, index))


def _logprobs(logits, tokens, rows: list[int], params: list[SamplingParams]):
    """(chosen, top values, top ids) at every position of every row; rows that asked for none are zeros."""
    r, w, _ = logits.shape
    index = on_device(rows, torch.int64, logits.device)
    lp = torch.log_softmax(logits[index], dim=-1)
    k = max(1, max(params[i].logprobs or 0 for i in rows))  # (rows: those that ask for logprobs)
    top_vals, top_ids = lp.topk(k, dim=-1)
    chosen = lp.gather(-1, tokens[index][..., None]).squeeze(-1)
    full = (
        logits.new_zeros((r, w)),
        logits.new_zeros((r, w, k)),
        torch.zeros((r, w, k), dtype=torch.int64, device=logits.device),
    )
    for dst, src in zip(full, (chosen, top_vals, top_ids)):
        dst[index] = src
    return full

"""Speculative decoding with the MTP module: one rank's part of a step (every rank of a tensor-parallel engine runs
it; the leader decides what is accepted).

A request that decodes runs its last token x and the K tokens drafted after it through the target in one step, as
K+1 one-token decode rows (runner.host_step). Attention writes their KV at the K+1 positions after the request's
length and reads each row's own prefix; the GDN layers run the K+1 tokens from the request's state and keep the
state after each token in the draft pool (`gdn_verify`, `conv1d_verify`), leaving the request's own slot as it was.
Then, on the device:

1. the leader accepts a run of drafts and a new token per request (spec/accept.py) and sends the counts to the
   other ranks;
2. each request's state becomes the one after its last accepted input (`commit`: a copy from the draft pool); its
   KV needs nothing: what lies past the accepted length is overwritten later, and nothing reads past a length;
3. the drafter proposes the next K tokens (spec/drafter.py), which stay on the device for the next step.

So a step's inputs are known on the device before the host has read the step before: with async scheduling the
next step is launched first and takes its inputs, and the accepted count that moves its positions on, from these
outputs (`place`). The host learns the counts when it reads the step (step.py, core.py), and never commits a
request's state past a token that ends it as the device can tell (accept.py), so a finished request leaves exactly
its tokens' state to the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltamesh.engine.penalties import LogitAdjustments, VerifyRows
from deltamesh.engine.spec.accept import Accepted, AcceptInputs, accept
from deltamesh.engine.spec.drafter import DraftContext, Drafter, MtpDrafter
from deltamesh.engine.spec.host import SpecHost
from deltamesh.kernels.batch import Verification

if TYPE_CHECKING:
    from deltamesh.engine.spec.graphs import VerifyGraphs


@dataclass
class SpecOutputs:
    """A step's outputs per sampling request, on every rank; `accepted` (the full result) on the leader only."""

    next_tokens: torch.Tensor  # [R] the new last token: the next step's first input
    advanced: torch.Tensor  # [R] inputs committed beyond the first (accepted drafts)
    drafts: torch.Tensor  # [R, K] the next step's drafts
    done: torch.Tensor  # [R] bool: a new token ends the request (the next step commits only its first input)
    accepted: Accepted | None = None


@dataclass
class SpecSampling:
    """The leader's sampling of a step: its sampling requests' host facts and the engine's generator."""

    inputs: AcceptInputs
    generator: torch.Generator
    requests: list | None = None
    draft: bool = True  # False: the step backed off (no drafts proposed)
    adjustments: LogitAdjustments | None = None  # penalties, logit_bias, min_tokens (penalties.py)
    # grammar masks over the step's logits, in place (num_verify, width: grammar.GrammarMasks), when one samples
    masks: Callable[[torch.Tensor, int, int], None] | None = None


class SpecRunner:
    def __init__(self, runner, draft_pool, k: int, drafter: Drafter | None = None):
        self.runner, self.draft_pool, self.k = runner, draft_pool, k
        self.width = k + 1
        self.drafter: Drafter = drafter or MtpDrafter()
        self.previous: SpecOutputs | None = None  # this rank's last step's outputs
        self.graphs: VerifyGraphs | None = None  # once captured (CUDA)
        self._spec_arrays: list[torch.Tensor] = []
        self._delta: torch.Tensor | None = None  # [num_verify] the previous step's accepted drafts per verifier

    # ---- inputs ------------------------------------------------------------------------------------------
    def fill_drafts(self, spec: SpecHost, arrays: list[torch.Tensor], ids: torch.Tensor) -> None:
        """The leader: the drafts of verifying requests whose last step has not been read, from its outputs."""
        source = arrays[0]
        if self.previous is None or not spec.num_verify:
            return
        view = ids[: spec.num_verify * self.width].view(spec.num_verify, self.width)
        pending = source >= 0
        view[:, 1:] = torch.where(pending[:, None], self.previous.drafts[source.clamp(min=0)], view[:, 1:])

    def place(self, spec: SpecHost, arrays: list[torch.Tensor], batch) -> Verification | None:
        """Move the decode rows of requests whose last step was launched but not read on by the drafts that step
        accepted (positions, lengths and KV slots, on the device); the batch's verification."""
        self._spec_arrays = arrays
        source, moves = arrays[0], arrays[1]
        self._delta = None
        if self.previous is not None and moves.shape[1]:
            rows, delta = moves[0], self.previous.advanced[moves[1]]
            batch.positions[rows] += delta
            batch.seq_lens[rows] += delta.to(batch.seq_lens.dtype)
            page = self.runner.kv_pool.page_size
            at = batch.positions[rows]
            pages = batch.block_tables[rows].gather(1, (at // page)[:, None]).squeeze(1).long()
            batch.slot_mapping[rows] = pages * page + at % page
            batch.decode_lengths_on_device = True
        if not spec.num_verify:
            return None
        n, w = spec.num_verify, self.width
        if self.previous is not None:
            self._delta = torch.where(source >= 0, self.previous.advanced[source.clamp(min=0)], 0)
        slots = batch.state_slots[: n * w : w].long()
        return Verification(n, w, self.draft_pool, slots[:, None] * w + torch.arange(w, device=slots.device))

    # ---- the step ----------------------------------------------------------------------------------------
    def capture_graphs(self, max_batch: int, max_pages: int) -> None:
        from deltamesh.engine.spec.graphs import VerifyGraphs

        self.graphs = VerifyGraphs(self, max_batch, max_pages)

    def run(self, spec: SpecHost, ids, batch, sampling: SpecSampling | None, between_layers=None) -> SpecOutputs:
        """The forward pass (a step whose every row verifies from CUDA graphs: spec/graphs.py), the acceptance (the
        leader's, sent to the other ranks), the commit and the drafts."""
        runner, model = self.runner, self.runner.model
        r, n = len(spec.sample_rows), spec.num_verify
        graphs = self.graphs if self.graphs is not None and self.graphs.fits(batch, spec) else None
        logits: torch.Tensor | None
        if graphs is not None:
            runner.graph_steps += 1
            hidden, logits = graphs.forward(ids, batch)
        else:
            hidden, logits = runner.forward(ids, batch, between_layers)
            if logits is not None:  # a plain decode step's graph: every row samples
                logits = logits if r else None
            elif r:  # on every rank: its part in the vocabulary gather
                logits = model.logits(hidden[batch.sample_index])
        if sampling is not None:  # the leader decides
            if logits is None:
                logits = hidden.new_empty((0, model.cfg.vocab_size), dtype=torch.float32)
            accepted = self._accept(logits, ids, spec, sampling)
            packed = torch.stack([accepted.counts - 1, accepted.next_tokens, accepted.done.long()])
        else:
            accepted, packed = None, torch.empty((3, r), dtype=torch.int64, device=hidden.device)
        if runner.tp is not None:
            runner.tp.broadcast(packed)
        advanced, next_tokens, done = packed[0], packed[1], packed[2].bool()
        source = self._spec_arrays[0]
        if n and self.previous is not None:  # a request the previous step ended commits its first input only
            ended = (source >= 0) & self.previous.done[source.clamp(min=0)]
            advanced[:n] = torch.where(ended, 0, advanced[:n])
        drafts: torch.Tensor | None
        if graphs is not None:
            drafts = graphs.after_accept(advanced, next_tokens)
        else:
            drafts = self._after_accept(spec, ids, batch, hidden, advanced, next_tokens, sampling)
        if drafts is None:  # placeholders: as exact as any drafts, never accepted but by chance
            drafts = next_tokens[:, None].expand(r, self.k).contiguous()
        self.previous = SpecOutputs(next_tokens, advanced, drafts, done, accepted)
        return self.previous

    def _after_accept(self, spec: SpecHost, ids, batch, hidden, advanced, next_tokens, sampling) -> torch.Tensor | None:
        """Commit, then the drafter's turn (eagerly)."""
        runner = self.runner
        _, _, sample_rows, sample_seqs, next_fix = self._spec_arrays
        r, n, w = sample_rows.shape[0], spec.num_verify, spec.width
        if n:
            self.commit(batch, advanced[:n], n, w)
        next_ids = self.next_ids(ids, advanced, next_tokens, n)
        next_ids[next_fix[0]] = next_fix[1]
        next_ids[sample_rows[n:]] = next_tokens[n:]
        last_rows = sample_rows + torch.where(torch.arange(r, device=ids.device) < n, advanced, 0)
        ctx = DraftContext(
            runner.model,
            runner.kv_pool,
            runner.kernels,
            ids,
            hidden,
            batch,
            next_ids,
            last_rows,
            next_tokens,
            batch.block_tables[sample_seqs],
            self.k,
            spec.draft,
            sampling.requests if sampling is not None else None,
        )
        return self.drafter.draft(ctx)

    def next_ids(self, ids: torch.Tensor, advanced: torch.Tensor, next_tokens: torch.Tensor, n: int) -> torch.Tensor:
        """The token after each input: the next input, but for the last of a verifying request's inputs and its
        last accepted one: its new token (the MTP's catch-up reads these: spec/drafter.py)."""
        out = ids.roll(-1)
        if n:
            view = out[: n * self.width].view(n, self.width)
            view[:, -1] = next_tokens[:n]
            view.scatter_(1, advanced[:n, None], next_tokens[:n, None])
        return out

    def _accept(self, logits: torch.Tensor, ids: torch.Tensor, spec: SpecHost, sampling: SpecSampling) -> Accepted:
        """The verifying requests' runs (W rows of logits each), then the other sampling requests' one token; the
        grammars' masks and the logits stage first, over every verified position (its drafts before it as if
        generated), and the emitted tokens counted after."""
        n, w = spec.num_verify, spec.width
        inputs, generator = sampling.inputs, sampling.generator
        drafts = ids[: n * w].view(n, w)[:, 1:]
        if sampling.masks is not None:  # logprobs are of the masked logits, as without drafts
            sampling.masks(logits, n, w)
        raw, counting = logits, None
        if sampling.adjustments is not None and sampling.requests is not None:
            verify = VerifyRows(n, w, drafts)
            logits, counting = sampling.adjustments.apply(logits, sampling.requests, verify)
        parts = []
        if n:
            verify_logits, verify_raw = (t[: n * w].view(n, w, -1) for t in (logits, raw))
            parts.append(
                accept(verify_logits, drafts, [self.k] * n, _rows(inputs, 0, n), self._delta, generator, verify_raw)
            )
        r = len(inputs.params)
        if r > n:
            single, single_raw = logits[n * w :][:, None], raw[n * w :][:, None]
            none = torch.zeros((r - n, 0), dtype=torch.int64, device=logits.device)
            parts.append(accept(single, none, [0] * (r - n), _rows(inputs, n, r), None, generator, single_raw))
        if not parts:  # no request samples in the step (prompt chunks, a request whose grammar still compiles)
            none = torch.zeros((0, w), dtype=torch.int64, device=logits.device)
            parts.append(Accepted(none, none[:, 0], none[:, 0], none[:, 0].bool()))
        accepted = _concat(parts, w)
        if counting is not None:
            assert sampling.adjustments is not None, "counting comes from the adjustments"
            sampling.adjustments.count(counting, accepted.tokens, accepted.counts)
        return accepted

    def commit(self, batch, advanced: torch.Tensor, n: int, w: int) -> None:
        """Each verifying request's state := the one after its last accepted input (from the draft pool)."""
        states, drafts = self.runner.state_pool, self.draft_pool
        slots = batch.state_slots[: n * w : w].long()
        src = slots * w + advanced
        for pool, draft in ((states.conv, drafts.conv), (states.recurrent, drafts.recurrent)):
            pool.index_copy_(0, slots, draft.index_select(0, src))


def _rows(inputs: AcceptInputs, start: int, stop: int) -> AcceptInputs:
    return AcceptInputs(
        inputs.params[start:stop], inputs.output_index[start:stop], inputs.stops[start:stop], inputs.budget[start:stop]
    )


def _concat(parts: list[Accepted], w: int) -> Accepted:
    """One Accepted of several, their token rows padded to `w`."""
    if len(parts) == 1 and parts[0].tokens.shape[1] == w:
        return parts[0]
    pad = lambda t: torch.nn.functional.pad(t, (0, w - t.shape[1]))  # noqa: E731
    out = Accepted(
        torch.cat([pad(p.tokens) for p in parts]),
        torch.cat([p.counts for p in parts]),
        torch.cat([p.next_tokens for p in parts]),
        torch.cat([p.done for p in parts]),
    )
    if any(p.logprobs is not None for p in parts):
        k = max(p.logprobs[1].shape[-1] for p in parts if p.logprobs is not None)
        lps = []
        for p in parts:
            rows, width = p.tokens.shape
            if p.logprobs is None:
                chosen, vals = p.tokens.new_zeros((rows, width), dtype=torch.float32), None
                lp = (chosen, chosen.new_zeros((rows, width, k)), p.tokens.new_zeros((rows, width, k)))
            else:
                chosen, vals, ids = p.logprobs
                grow = (0, k - vals.shape[-1])
                lp = (chosen, torch.nn.functional.pad(vals, grow), torch.nn.functional.pad(ids, grow))
            lps.append((pad(lp[0]), *(torch.nn.functional.pad(t, (0, 0, 0, w - width)) for t in lp[1:])))
        chosen, vals, ids = (torch.cat([lp[i] for lp in lps]) for i in range(3))
        out.logprobs = (chosen, vals, ids)
    return out

"""A speculative step's results on their way to the host, and what the host does with them: each sampling
request's new tokens (one to K+1), its accepted drafts (which move its computed length on), the drafts the next
step verifies (kept on the request for a step launched after this one is read) and the acceptance counts."""

from __future__ import annotations

import numpy as np
import torch

from deltamesh.engine.request import Request, Status
from deltamesh.engine.sampling import TokenLogprobs
from deltamesh.engine.spec.accept import AcceptInputs
from deltamesh.engine.spec.runner import SpecOutputs


def accept_inputs(requests: list[Request], max_model_len: int) -> AcceptInputs:
    """The sampling requests' host facts for the leader's acceptance (spec/accept.py)."""
    stops = []
    budget = []
    for r in requests:
        p = r.params
        # under a grammar an EOS token ends the request even with ignore_eos (Request._stops_on)
        ids = list(p.stop_token_ids) + ([] if p.ignore_eos and r.grammar is None else sorted(r.eos_token_ids))
        stops.append(ids)
        outputs = len(r.output_ids) + r.num_pending
        budget.append(min(p.max_tokens - outputs, max_model_len - len(r.prompt_ids) - outputs))
    width = max((len(s) for s in stops), default=0) or 1
    table = np.full((len(requests), width), -1, dtype=np.int64)
    for row, ids in enumerate(stops):
        table[row, : len(ids)] = ids
    return AcceptInputs(
        [r.params for r in requests],
        [len(r.output_ids) + r.num_pending for r in requests],
        table,
        np.asarray(budget, dtype=np.int64),
    )


class SpecTokens:
    """As sampling.SampledTokens: `tokens` [R] on the device (each request's new last token, the next step's
    input), the rest copied to the host behind the step without waiting for it."""

    def __init__(self, outputs: SpecOutputs, requests: list[Request], num_verify: int, k: int):
        acc = outputs.accepted
        assert acc is not None, "the leader's outputs: it accepted the drafts (SpecRunner.run)"
        self.tokens = outputs.next_tokens
        self.num_verify, self.k = num_verify, k
        self._logprob_counts = [r.params.logprobs for r in requests]
        parts = [acc.tokens, acc.counts, outputs.advanced, outputs.drafts]
        if acc.logprobs is not None:
            parts += list(acc.logprobs)
        cuda = self.tokens.is_cuda
        self._host = [t.to("cpu", non_blocking=True) if cuda else t for t in parts]
        self._done = None
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.tokens.device))

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def result(self):
        """(tokens per row, logprobs per row, accepted drafts per row, next drafts per row)."""
        if self._done is not None:
            self._done.synchronize()
        tokens, counts, advanced, drafts = (t.tolist() for t in self._host[:4])
        rows = [row[:n] for row, n in zip(tokens, counts)]
        logprobs: list[list[TokenLogprobs | None]] = [[None] * n for n in counts]
        if len(self._host) > 4:
            chosen, vals, ids = (t.tolist() for t in self._host[4:])
            for i, want in enumerate(self._logprob_counts):
                if want is not None:
                    logprobs[i] = [
                        TokenLogprobs(tok, chosen[i][j], list(zip(ids[i][j][:want], vals[i][j][:want])))
                        for j, tok in enumerate(rows[i])
                    ]
        return rows, logprobs, advanced, drafts


def settle(
    requests: list[Request],
    tokens: list[list[int]],
    advanced: list[int],
    drafts: list[list[int]],
    num_verify: int,
    stats,
) -> None:
    """The host's side of a read speculative step, before its tokens are appended: each running request's computed
    length moves on by the drafts it accepted (a preempted one starts over), its drafts are kept for a next step
    launched after this read, and the acceptance is counted (per draft position).

    A verify row's drafts are those kept on its request at the previous read (`draft_ids`, what the row's inputs
    were built from, on the host or the device); the accepted ones are the run of its new tokens that equals them.
    Not `advanced`: a run that ends the request at an accepted draft (a stop token, max_tokens) commits one input
    fewer than the drafts it emits. A row of a request that an earlier step ended is not counted: its tokens are
    dropped."""
    for row, (req, new, moved, proposed) in enumerate(zip(requests, tokens, advanced, drafts)):
        if req.status != Status.RUNNING:
            continue
        if row < num_verify:
            verified = req.draft_ids[: len(proposed)]
            accepted = next((i for i, (a, b) in enumerate(zip(new, verified)) if a != b), min(len(new), len(verified)))
            stats.spec_drafts += len(proposed)
            stats.spec_accepted += accepted
            for position in range(accepted):
                stats.spec_accepted_at[position] += 1
        req.num_computed += moved
        req.draft_ids = proposed


def state_known(req: Request) -> bool:
    """Whether a finished request's state holds exactly its first `num_computed` tokens, and no token past its
    end, so the prefix cache may keep it. Always, but in a speculative engine when it ended on a stop string (which
    the device cannot see): an accepted run may then have gone past the string's last token, and a verify step
    launched before the ending was read commits drafts the host has not counted."""
    if not isinstance(req.stop_reason, str):  # a stop token or the length: the device ended the run there
        return True
    in_flight = req.num_pending > 0 and req.verifying
    return not in_flight and req.num_computed <= len(req.prompt_ids) + len(req.output_ids)

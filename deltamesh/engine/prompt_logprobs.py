"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's extension; what lm-eval's loglikelihood tasks read through
completions' `echo`): each prompt token's log-probability given the tokens before it, from the model's raw logits at
the position before it, with its rank in the vocabulary and the top k there.

They come from the hidden states of the step that computes each prompt chunk (`host_rows` picks the rows,
ModelRunner.forward computes them), a block of rows at a time (a long chunk's whole float32 logits would take
gigabytes), and travel to the host beside the step's sampled tokens (`PromptLogprobs`, read with them). A prompt
computed again after a preemption asks only for the positions not asked before (`Request.prompt_logprobs_asked`);
such a request never starts from the prefix cache (prefix_cache.acquire), whose positions have no logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltamesh.engine.request import Request, TokenLogprobs

BLOCK_BYTES = 256 << 20  # one block's float32 logits


def span(req: Request, start: int, num_tokens: int) -> tuple[int, int]:
    """The positions [first, end) of `req`'s chunk [start, start + num_tokens) whose next prompt token's logprob
    it gives: the prompt's last position predicts the first output token, which is no prompt logprob."""
    return max(start, req.prompt_logprobs_asked), min(start + num_tokens, len(req.prompt_ids) - 1)


@dataclass
class PromptRows:
    """A step's prompt-logprob rows (host side, sent to tensor-parallel followers with the step)."""

    rows: np.ndarray  # int64: the step's token rows, grouped by request in position order
    targets: np.ndarray  # int64: the prompt token each row predicts
    top: int  # the most top entries any of them asks for
    owners: list[tuple[int, int, int]]  # (item index, first position, rows) per request, in row order


def host_rows(items, nv: int, w: int, starts, q_lens, last_seq) -> PromptRows | None:
    """The rows of `items` (runner.host_step's order and arrays: verifying items first, `w` rows each; an item that
    takes a checkpoint in passing runs as a head sequence and a tail sequence, `last_seq[i]`) whose next prompt
    token's logprob their requests ask for; None when none does (the usual step: one attribute read per item)."""
    wanting = [i for i in range(nv, len(items)) if items[i].request.params.prompt_logprobs is not None]
    if not wanting:
        return None
    first_token = np.cumsum(q_lens) - q_lens
    rows, targets, owners, top = [], [], [], 0
    for i in wanting:
        req = items[i].request
        first, end = span(req, req.num_computed, items[i].num_tokens)
        if end <= first:
            continue
        head = nv * w + i - nv
        for seq in (head,) if last_seq[i] == head else (head, int(last_seq[i])):
            s, q = int(starts[seq]), int(q_lens[seq])
            lo, hi = max(first, s), min(end, s + q)
            if hi > lo:
                rows.append(np.arange(lo - s, hi - s) + first_token[seq])
        targets += req.prompt_ids[first + 1 : end + 1]
        owners.append((i, first, end - first))
        top = max(top, req.params.prompt_logprobs)
    if not owners:
        return None
    return PromptRows(np.concatenate(rows).astype(np.int64), np.asarray(targets, np.int64), top, owners)


class PromptLogprobs:
    """A step's prompt logprobs, computed on the device from its hidden states and on their way to the host."""

    def __init__(
        self, logits_of, vocab: int, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, host: PromptRows
    ):
        """`logits_of`: the model's float32 logits [rows, vocab] of some hidden rows (a collective under tensor
        parallelism: every rank calls it alike, with the same rows); `rows`, `targets`: `host`'s on the device."""
        self.owners = host.owners
        n, dev, top = rows.shape[0], hidden.device, host.top
        chosen = torch.empty(n, dtype=torch.float32, device=dev)
        ranks = torch.empty(n, dtype=torch.int64, device=dev)
        top_vals = torch.empty(n, top, dtype=torch.float32, device=dev)
        top_ids = torch.empty(n, top, dtype=torch.int64, device=dev)
        block = max(1, BLOCK_BYTES // (4 * vocab))
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            lp = torch.log_softmax(logits_of(hidden[rows[lo:hi]]), dim=-1)
            mine = lp.gather(1, targets[lo:hi, None]).squeeze(1)
            chosen[lo:hi] = mine
            ranks[lo:hi] = (lp > mine[:, None]).sum(-1) + 1  # 1: the likeliest (ties: the best rank)
            if top:
                top_vals[lo:hi], top_ids[lo:hi] = lp.topk(top, dim=-1)
        to_host = (lambda t: t.to("cpu", non_blocking=True)) if hidden.is_cuda else (lambda t: t)
        self._host = [to_host(t) for t in (targets, chosen, ranks, top_vals, top_ids)]
        self._done = None
        if hidden.is_cuda:
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(dev))

    def entries(self, counts: list[tuple[int, int]]) -> list[list[TokenLogprobs]]:
        """Per (rows, top k) of `counts`, in row order: each row's TokenLogprobs; waits for the copy."""
        if self._done is not None:
            self._done.synchronize()
        targets, chosen, ranks, top_vals, top_ids = (t.tolist() for t in self._host)
        out, row = [], 0
        for n, k in counts:
            out.append(
                [
                    TokenLogprobs(targets[r], chosen[r], list(zip(top_ids[r][:k], top_vals[r][:k])), ranks[r])
                    for r in range(row, row + n)
                ]
            )
            row += n
        return out


@dataclass
class StepPromptLogprobs:
    """What a launched step hands its requests: the logprobs and, per request, how many rows are its."""

    logprobs: PromptLogprobs
    owners: list[tuple[Request, int]]  # (request, rows) in row order

    @classmethod
    def of(cls, logprobs: PromptLogprobs | None, items) -> StepPromptLogprobs | None:
        """`items`: the step's, as the runner had them. Marks each owner's positions as asked (a recomputation
        after a preemption skips them)."""
        if logprobs is None:
            return None
        owners = []
        for i, first, n in logprobs.owners:
            req = items[i].request
            req.prompt_logprobs_asked = first + n
            owners.append((req, n))
        return cls(logprobs, owners)

    def deliver(self) -> None:
        """Append each request's entries (the step's tokens are read: their copy has landed too)."""
        reqs = [req for req, _ in self.owners]
        counts = [(n, req.params.prompt_logprobs or 0) for req, n in self.owners]
        for req, entries in zip(reqs, self.logprobs.entries(counts)):
            req.prompt_logprobs += entries

"""Penalties, logit_bias and min_tokens: the logits stage between the forward pass and sampling (step.py), applied
to the whole batch on the device.

What a request needs from one step to the next stays on the device, in rows of its own while it runs:
- a counted row, for a request with a repetition, presence or frequency penalty: how often each vocabulary token
  has been generated ([V] int32) and which tokens its prompt holds ([V] bool): 5 bytes per vocabulary entry, 1.2 MB
  at Qwen3.5's 248k;
- a sparse row, for every request that adjusts its logits: its logit_bias entries and the token ids min_tokens holds
  back (its stop token ids, and end-of-sequence unless ignore_eos), with its min_tokens and how many tokens it has
  generated, about 17 kB.
The tokens a step samples are counted into the rows on the device, queued right behind the sampling, so the next
step, launched before the host has read them (async scheduling), sees them. A request's rows are built from its
prompt and output ids on the host when it first samples without them: a new request, one that runs again after a
preemption (the scheduler re-admits a preempted request only once its pending tokens are on the host), one whose
prompt state arrived from a prefill worker (its first token included). They are given up at the first step after
it stops running (finished, held for a puller, or preempted). So preemption, P/D and the prefix cache leave the
counts exact, and a step in which no request adjusts its logits runs no kernel here.

Rows: one of each kind per running request that needs it, so at most --max-num-seqs of each; each pool grows by
doubling when full and stays at its high-water mark (a counted row costs what the step's own logits row costs).

A speculative engine's verify step (engine/spec/) runs the stage over every verified position: position j of a
request's K+1 sees its output so far and its drafts 1..j, as if generated (their counts, and j more tokens toward
min_tokens: the drafts are in the logits only where they are all accepted), and the acceptance then counts only the
tokens the request emits (accepted drafts and the target's one more), so the rows stay exact through rejections.

The order is vLLM's: min_tokens and logit_bias first, then the repetition penalty (transformers' definition: a
seen token's logit divided by it when positive, multiplied when not; over prompt and output), then the frequency
and presence penalties (OpenAI's: minus the penalty times the token's count in the output, minus the penalty once
if it is there). Logprobs are taken from the logits before this stage, as vLLM's default reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltamesh.engine.request import Request, Status
from deltamesh.engine.sampling import on_device
from deltamesh.protocol.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS


class _Pool:
    """Rows of device tensors (dim 0), handed out and taken back on the host; grows by doubling."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device, rows: int):
        self.shapes, self.device = shapes, device
        self.tensors: dict[str, torch.Tensor] = {}
        self.free: list[int] = []
        self._grow(rows)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def take(self) -> int:
        if not self.free:
            self._grow(2 * self.capacity)
        return self.free.pop()

    def _grow(self, rows: int) -> None:
        old = self.capacity if self.tensors else 0
        for name, (shape, dtype) in self.shapes.items():
            grown = torch.zeros((rows, *shape), dtype=dtype, device=self.device)
            if old:
                grown[:old] = self.tensors[name]
            self.tensors[name] = grown
        self.free += range(rows - 1, old - 1, -1)  # lowest first


@dataclass
class _Rows:
    request: Request
    sparse: int
    counted: int | None  # only with a penalty


@dataclass
class VerifyRows:
    """The layout of a verify step's logits: each of its first `num_verify` sampling requests has `width` rows (its
    positions 0..K), every other one a row; `drafts` [num_verify, K] on the device (position j follows 1..j)."""

    num_verify: int
    width: int
    drafts: torch.Tensor


@dataclass
class _Counting:
    """A step's rows to count its new tokens into (`count`), by the sampling requests' indices."""

    counted_at: torch.Tensor | None  # indices of the counted requests
    counted: torch.Tensor | None  # their counted rows
    sparse_at: torch.Tensor  # indices of every adjusted request
    sparse: torch.Tensor  # their sparse rows


class LogitAdjustments:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self._counted: _Pool | None = None  # made when first needed: a server whose requests never ask costs nothing
        self._sparse: _Pool | None = None
        self._rows: dict[int, _Rows] = {}  # id(request) -> its rows (the entry keeps the request alive)

    @property
    def rows_in_use(self) -> int:
        return len(self._rows)

    @torch.inference_mode()  # the logits are inference tensors (runner.py), and so are the rows made with them
    def apply(
        self, logits: torch.Tensor, sampling: list[Request], verify: VerifyRows | None = None
    ) -> tuple[torch.Tensor, _Counting | None]:
        """(the logits to sample from, what to pass to `count` with the step's new tokens); row i is request
        `sampling[i]`'s, or with `verify` the rows are laid out as it says. `logits` itself when no request adjusts
        them (nothing run); else adjusted in place, or in a copy when a request asks for logprobs (those are of
        `logits` as they were)."""
        if self._rows:
            self._release_stopped()
        at = [i for i, r in enumerate(sampling) if r.adjusts_logits and r.status is Status.RUNNING]
        if not at:
            return logits, None
        if any(r.params.logprobs is not None for r in sampling):
            logits = logits.clone()
        if verify is not None and not verify.num_verify:
            verify = None
        return logits, self._adjust(logits, sampling, at, verify)

    def _adjust(self, logits: torch.Tensor, sampling: list[Request], at: list[int], verify: VerifyRows | None):
        rows = [self._rows.get(id(sampling[i])) or self._build(sampling[i]) for i in at]
        requests = np.asarray(at, dtype=np.int64)
        sparse = np.asarray([r.sparse for r in rows], dtype=np.int64)
        counted_of = np.asarray([-1 if r.counted is None else r.counted for r in rows], dtype=np.int64)
        # each adjusted request's positions: one row, or a verifying request's `width`
        if verify is None:
            owner, offsets, batch_rows = np.arange(len(at)), np.zeros(len(at), dtype=np.int64), requests
        else:
            n, w = verify.num_verify, verify.width
            spans = np.where(requests < n, w, 1)
            owner = np.repeat(np.arange(len(at)), spans)
            offsets = np.arange(len(owner)) - np.repeat(np.cumsum(spans) - spans, spans)
            batch_rows = np.where(requests < n, requests * w, n * (w - 1) + requests)[owner] + offsets
        penalized = counted_of[owner] >= 0
        with_counts = counted_of >= 0
        # every index the step needs in one copy to the device: per position (batch row, offset, sparse row), per
        # penalized position (batch row, offset, counted row, its request's index), per adjusted request (index,
        # sparse row), per penalized request (index, counted row)
        parts = [
            batch_rows,
            offsets,
            sparse[owner],
            batch_rows[penalized],
            offsets[penalized],
            counted_of[owner][penalized],
            requests[owner][penalized],
            requests,
            sparse,
            requests[with_counts],
            counted_of[with_counts],
        ]
        index = on_device(np.concatenate(parts).tolist(), torch.int64, self.device)
        split = index.split([len(p) for p in parts])
        at_rows, at_offsets, at_sparse, pen_rows, pen_offsets, pen_counted, pen_requests = split[:7]
        adjusted, adjusted_sparse, counted_requests, counted_rows = split[7:]
        self._apply_sparse(logits, at_rows, at_sparse, at_offsets if verify is not None else None)
        if not with_counts.any():
            return _Counting(None, None, adjusted, adjusted_sparse)
        drafts = None
        if verify is not None:  # a position's drafts before it: those of its request, where it verifies
            source = verify.drafts[pen_requests.clamp(max=verify.num_verify - 1)]
            drafts = (source, torch.arange(verify.width - 1, device=self.device)[None, :] < pen_offsets[:, None])
        self._apply_penalties(logits, pen_rows, pen_counted, drafts)
        return _Counting(counted_requests, counted_rows, adjusted, adjusted_sparse)

    @torch.inference_mode()
    def count(self, counting: _Counting | None, tokens: torch.Tensor, emitted: torch.Tensor | None = None) -> None:
        """Count the step's new tokens into the rows: `tokens` [R] one per request, or [R, W] with `emitted` [R]
        the first of each row to count (a verify step's accepted drafts and one more); on the device."""
        if counting is None:
            return
        assert self._sparse is not None, "counting rows come from the sparse pool"
        if emitted is None:
            self._sparse["generated"][counting.sparse] += 1
        else:
            self._sparse["generated"][counting.sparse] += emitted[counting.sparse_at]
        if counting.counted is None:
            return
        assert self._counted is not None, "counted rows come from the counted pool"
        counts = self._counted["counts"]
        if emitted is None:  # one token per row: no (row, token) pair twice
            counts[counting.counted, tokens[counting.counted_at]] += 1
            return
        new = tokens[counting.counted_at]  # [M, W]: a row may hold a token twice, so accumulated
        valid = torch.arange(new.shape[1], device=new.device)[None, :] < emitted[counting.counted_at][:, None]
        counts.index_put_((counting.counted[:, None].expand_as(new), new), valid.to(counts.dtype), accumulate=True)

    # ---- on the device ---------------------------------------------------------------------------------
    def _apply_sparse(
        self, logits: torch.Tensor, at: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor | None
    ) -> None:
        """`offsets`: each verified position's drafts before it, which count as generated."""
        pool = self._sparse
        assert pool is not None, "rows come from the sparse pool"
        generated = pool["generated"][rows] if offsets is None else pool["generated"][rows] + offsets
        holding = generated < pool["min_tokens"][rows]  # min_tokens not reached yet
        added = torch.where(pool["is_stop"][rows] & holding[:, None], float("-inf"), pool["values"][rows])
        logits[at] = logits[at].scatter_add_(1, pool["ids"][rows], added)  # padding adds 0 to token 0

    def _apply_penalties(
        self, logits: torch.Tensor, at: torch.Tensor, rows: torch.Tensor, drafts: tuple | None
    ) -> None:
        """`drafts`: ([P, K] each verified position's request's drafts, [P, K] bool those before the position),
        which count as generated there."""
        pool = self._counted
        assert pool is not None, "rows come from the counted pool"
        x, counts = logits[at], pool["counts"][rows]
        if drafts is not None:
            tokens, before = drafts
            counts.scatter_add_(1, tokens, before.to(counts.dtype))
        generated = counts > 0
        repetition, frequency, presence = pool["penalties"][rows].unbind(1)
        seen = pool["in_prompt"][rows] | generated
        x = torch.where(seen, torch.where(x > 0, x / repetition[:, None], x * repetition[:, None]), x)
        x -= frequency[:, None] * counts + presence[:, None] * generated
        logits[at] = x

    # ---- rows, on the host ------------------------------------------------------------------------------
    def _release_stopped(self) -> None:
        """Give up the rows of requests that no longer run (finished, held, preempted): their last step's counting
        is queued before any rebuild of the rows for another request."""
        for key, rows in list(self._rows.items()):
            if rows.request.status is not Status.RUNNING:
                del self._rows[key]
                assert self._sparse is not None, "rows come from the sparse pool"
                self._sparse.free.append(rows.sparse)
                if rows.counted is not None:
                    assert self._counted is not None, "counted rows come from the counted pool"
                    self._counted.free.append(rows.counted)

    def _build(self, req: Request) -> _Rows:
        if req.num_pending:  # the scheduler never lets a request without rows run ahead of its tokens
            raise RuntimeError(f"request {req.request_id}: logit rows built with {req.num_pending} tokens pending")
        p = req.params
        if self._sparse is None:
            # logit_bias's entries, then the stop ids min_tokens holds back (stop_token_ids and the model's
            # end-of-sequence tokens, the same for every request of an engine)
            width = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(req.eos_token_ids)
            self._sparse = _Pool(
                {
                    "ids": ((width,), torch.int64),
                    "values": ((width,), torch.float32),
                    "is_stop": ((width,), torch.bool),
                    "min_tokens": ((), torch.int64),
                    "generated": ((), torch.int64),
                },
                self.device,
                rows=8,
            )
        rows = _Rows(req, self._sparse.take(), None)
        stops = sorted({*p.stop_token_ids, *(() if p.ignore_eos else req.eos_token_ids)}) if p.min_tokens else []
        ids = [*p.logit_bias, *stops]
        s, r, n = self._sparse, rows.sparse, len(ids)
        s["ids"][r].zero_()
        s["values"][r].zero_()
        s["is_stop"][r].zero_()
        if n:
            s["ids"][r, :n] = on_device(ids, torch.int64, self.device)
            s["values"][r, : len(p.logit_bias)] = on_device(list(p.logit_bias.values()), torch.float32, self.device)
            s["is_stop"][r, len(p.logit_bias) : n] = True
        s["min_tokens"][r] = p.min_tokens
        s["generated"][r] = len(req.output_ids)
        if p.penalized:
            rows.counted = self._build_counted(req)
        self._rows[id(req)] = rows
        return rows

    def _build_counted(self, req: Request) -> int:
        if self._counted is None:
            v = self.vocab_size
            self._counted = _Pool(
                {
                    "counts": ((v,), torch.int32),
                    "in_prompt": ((v,), torch.bool),
                    "penalties": ((3,), torch.float32),
                },
                self.device,
                rows=4,
            )
        c, r, p = self._counted, self._counted.take(), req.params
        c["counts"][r].zero_()
        if req.output_ids:
            c["counts"][r].index_add_(
                0,
                on_device(req.output_ids, torch.int64, self.device),
                torch.ones(len(req.output_ids), dtype=torch.int32, device=self.device),
            )
        c["in_prompt"][r].zero_()
        c["in_prompt"][r, on_device(req.prompt_ids, torch.int64, self.device)] = True
        c["penalties"][r] = on_device(
            [p.repetition_penalty, p.frequency_penalty, p.presence_penalty], torch.float32, self.device
        )
        return r

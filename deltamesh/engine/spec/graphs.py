"""CUDA graphs for speculative decode steps, in which every request verifies its drafts (the shape of a decode step
with MTP on). A step of B requests replays the graphs of the smallest bucket >= B, in two parts around the
leader's acceptance, which stays eager (it draws random numbers and reads host-side sampling settings, and a
tensor-parallel leader sends its counts to the other ranks):

1. the target's forward pass over the B(K+1) rows and their logits (as cuda_graphs.DecodeGraphs);
2. the commit of each request's GDN state, the MTP's catch-up over the rows and its K drafts (spec/drafter.py).

Inputs are copied into static buffers; rows past B are padding on the scratch page and the scratch slot (their
states go to the scratch slot's draft states, their commit to the scratch slot), so they never touch a request's
state. Nothing in either part waits for the host. `capture=False` runs the same two parts as plain calls on the
same buffers (the CPU tests check the plumbing and the tokens with it).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

import structlog
import torch

from deltamesh.engine.cuda_graphs import CAPTURE_MODE, DEFAULT_BUCKETS
from deltamesh.engine.spec.drafter import DraftContext, MtpDrafter
from deltamesh.kernels.batch import StepBatch, Verification

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the type of a graph's memory pool (torch names it privately)

log = structlog.get_logger("deltamesh.cuda_graphs")


class VerifyGraphs:
    def __init__(self, spec, max_batch: int, max_pages: int, buckets=DEFAULT_BUCKETS, capture: bool = True):
        self.spec, self.runner = spec, spec.runner
        self.buckets = sorted(b for b in buckets if b <= max_batch) or [max_batch]
        self.max_pages, self.width = max_pages, spec.width
        dev, rows = self.runner.device, self.buckets[-1] * self.width
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        self.ids, self.positions, self.slot_mapping = zeros(rows), zeros(rows), zeros(rows)
        self.block_tables = zeros(rows, max_pages, dtype=torch.int32)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.state_slots = zeros(rows, dtype=torch.int32)
        self.advanced, self.next_tokens = zeros(self.buckets[-1]), zeros(self.buckets[-1])
        self.outputs: dict[int, tuple] = {}  # bucket -> (hidden, logits) of part 1
        self.drafts: dict[int, torch.Tensor] = {}  # bucket -> [bucket, K] of part 2
        self.parts: dict[int, tuple] = {}  # bucket -> (replay of part 1, replay of part 2)
        self.pool: _POOL_HANDLE | None = None
        if capture:
            self._capture()
        else:
            self.parts = {b: (lambda b=b: self._forward(b), lambda b=b: self._after_accept(b)) for b in self.buckets}

    def _batch(self, b: int) -> StepBatch:
        rows, w = b * self.width, self.width
        slots = self.state_slots[:rows:w].long()
        verify = Verification(b, w, self.spec.draft_pool, slots[:, None] * w + torch.arange(w, device=slots.device))
        return StepBatch(
            num_decode=rows,
            query_lens=[1] * rows,
            context_lens=[0] * rows,  # on the device only
            seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows],
            slot_mapping=self.slot_mapping[:rows],
            state_slots=self.state_slots[:rows],
            positions=self.positions[:rows],
            verify=verify,
            decode_lengths_on_device=True,
        )

    def _forward(self, b: int) -> None:
        r = self.runner
        hidden = r.model(self.ids[: b * self.width], self._batch(b), r.kv_pool, r.state_pool, r.kernels)
        self.outputs[b] = (hidden, r.model.logits(hidden))

    def _after_accept(self, b: int) -> None:
        r, w = self.runner, self.width
        batch, ids = self._batch(b), self.ids[: b * w]
        advanced, next_tokens = self.advanced[:b], self.next_tokens[:b]
        self.spec.commit(batch, advanced, b, w)
        next_ids = self.spec.next_ids(ids, advanced, next_tokens, b)
        last_rows = torch.arange(b, device=ids.device) * w + advanced
        ctx = DraftContext(
            r.model,
            r.kv_pool,
            r.kernels,
            ids,
            self.outputs[b][0],
            batch,
            next_ids,
            last_rows,
            next_tokens,
            batch.block_tables[::w],
            self.spec.k,
            True,
        )
        self.drafts[b] = self.spec.drafter.draft(ctx)

    @torch.inference_mode()
    def _capture(self) -> None:
        dev, start = self.runner.device, time.monotonic()
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
                replays = []
                for part in (self._forward, self._after_accept):
                    part(b)  # warm up: kernel compilation and autotuning stay out of the graph
                    part(b)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                        part(b)
                    self.pool = graph.pool()
                    replays.append(graph.replay)
                self.parts[b] = tuple(replays)
        torch.cuda.current_stream(dev).wait_stream(stream)
        log.info("verify graphs captured", buckets=self.buckets, seconds=round(time.monotonic() - start, 1))

    def fits(self, batch: StepBatch, spec_host) -> bool:
        """A step whose every row verifies (no prompt tokens, no plain decodes), that drafts with the MTP module."""
        n = spec_host.num_verify
        return (
            n
            and spec_host.draft
            and batch.num_tokens == n * self.width
            and len(spec_host.sample_rows) == n
            and n <= self.buckets[-1]
            and batch.block_tables.shape[1] <= self.max_pages
            and type(self.spec.drafter) is MtpDrafter
        )

    def forward(self, ids: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Part 1: (hidden [B(K+1), hidden], logits [B(K+1), vocab]) views of static buffers."""
        rows = ids.shape[0]
        b = rows // self.width
        bucket = self.buckets[bisect.bisect_left(self.buckets, b)]
        self._bucket, end = bucket, bucket * self.width
        for buf, src in (
            (self.ids, ids),
            (self.positions, batch.positions),
            (self.slot_mapping, batch.slot_mapping),
            (self.state_slots, batch.state_slots),
            (self.seq_lens, batch.seq_lens),
        ):
            buf[:rows].copy_(src)
        width = batch.block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(batch.block_tables)
        self.block_tables[:rows, width:] = 0
        # padding rows: back to the scratch page and slot (a previous, larger step may have left real ids)
        self.slot_mapping[rows:end] = 0
        self.state_slots[rows:end] = 0
        self.seq_lens[rows:end] = 1
        self.positions[rows:end] = 0
        self.block_tables[rows:end] = 0
        self.parts[bucket][0]()
        hidden, logits = self.outputs[bucket]
        return hidden[:rows], logits[:rows]

    def after_accept(self, advanced: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Part 2 of the step part 1 ran: the drafts [B, K] (a view of a static buffer)."""
        b, bucket = advanced.shape[0], self._bucket
        self.advanced[:b].copy_(advanced)
        self.next_tokens[:b].copy_(next_tokens)
        self.advanced[b:bucket] = 0
        self.next_tokens[b:bucket] = 0
        self.parts[bucket][1]()
        return self.drafts[bucket][:b]

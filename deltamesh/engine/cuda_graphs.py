"""CUDA graphs of decode-only steps, one per bucketed batch size.

A decode step at batch B is replayed from the graph of the smallest bucket >= B. Inputs are copied into
static buffers; rows past B are padding that points at the scratch KV page and the scratch state slot
(page 0 and slot 0 of the pools), so they never touch a request's state. No host synchronisation happens
inside the graph, so the only sync of a steady-state decode step is reading the sampled tokens.
"""

from __future__ import annotations

import bisect

import structlog
import torch

from deltamesh.kernels.batch import StepBatch

log = structlog.get_logger("deltamesh.cuda_graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_pages: int, buckets=DEFAULT_BUCKETS):
        self.runner = runner
        self.buckets = sorted(b for b in buckets if b <= max_batch) or [max_batch]
        self.max_pages = max_pages
        dev = runner.device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)  # padding: scratch page 0, slot 0
        self.block_tables = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.state_slots = torch.zeros(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _batch(self, b: int) -> StepBatch:
        return StepBatch(
            num_decode=b, query_lens=[1] * b, context_lens=[0] * b,
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            state_slots=self.state_slots[:b], positions=self.positions[:b],
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        stream = torch.cuda.Stream(device=r.device)
        stream.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
                batch = self._batch(b)
                for _ in range(2):  # warm up: kernel compilation and autotuning stay out of the graph
                    r.model(self.input_ids[:b], batch, r.kv_pool, r.state_pool, r.kernels)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    hidden = r.model(self.input_ids[:b], batch, r.kv_pool, r.state_pool, r.kernels)
                    self.outputs[b] = r.model.logits(hidden)
                self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream(r.device).wait_stream(stream)
        log.info("decode graphs captured", buckets=self.buckets, max_context=self.max_pages * r.kv_pool.page_size)

    def fits(self, batch: StepBatch) -> bool:
        return (
            batch.num_decode == batch.num_seqs
            and batch.num_seqs <= self.buckets[-1]
            and batch.block_tables.shape[1] <= self.max_pages
        )

    def run(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step (B <= largest bucket)."""
        b = batch.num_seqs
        bucket = self.buckets[bisect.bisect_left(self.buckets, b)]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[:b].copy_(batch.slot_mapping)
        self.state_slots[:b].copy_(batch.state_slots)
        self.seq_lens[:b].copy_(batch.seq_lens)
        width = batch.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(batch.block_tables)
        self.block_tables[:b, width:] = 0
        # padding rows: back to the scratch page / slot (a previous, larger step may have left real ids)
        self.slot_mapping[b:bucket] = 0
        self.state_slots[b:bucket] = 0
        self.seq_lens[b:bucket] = 1
        self.block_tables[b:bucket] = 0
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]

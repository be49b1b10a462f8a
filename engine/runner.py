"""Turns a scheduled step into model inputs, runs the model, and returns the logits to sample from."""

from __future__ import annotations

import numpy as np
import torch

from engine.cache import KVPagePool, StatePool
from engine.models import HybridLM
from engine.scheduler import ScheduledItem
from kernels import Kernels
from kernels.batch import StepBatch


class ModelRunner:
    def __init__(self, model: HybridLM, kv_pool: KVPagePool, state_pool: StatePool, kernels: Kernels, device: torch.device):
        self.model, self.kv_pool, self.state_pool, self.kernels, self.device = model, kv_pool, state_pool, kernels, device
        self.graphs = None  # DecodeGraphs once captured

    def capture_decode_graphs(self, max_batch: int, max_context: int) -> None:
        from engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_batch, self.kv_pool.pages_for(max_context))
        self.graphs.capture()

    def prepare(self, items: list[ScheduledItem]) -> tuple[torch.Tensor, StepBatch]:
        """Items must be ordered decode-first (single-token items before chunks)."""
        ps = self.kv_pool.page_size
        ids, positions, q_lens, ctx_lens = [], [], [], []
        for it in items:
            start = it.request.num_computed
            ids.extend(it.request.all_ids[start : start + it.num_tokens])
            positions.append(np.arange(start, start + it.num_tokens))
            q_lens.append(it.num_tokens)
            ctx_lens.append(start)
        positions_np = np.concatenate(positions)
        page_counts = [-(-(c + q) // ps) for c, q in zip(ctx_lens, q_lens)]
        tables = np.full((len(items), max(page_counts)), -1, dtype=np.int32)
        slot_mapping = np.empty(len(positions_np), dtype=np.int64)
        offset = 0
        for row, (it, n_pages, pos) in enumerate(zip(items, page_counts, positions)):
            pages = np.asarray(it.request.pages[:n_pages], dtype=np.int64)
            tables[row, :n_pages] = pages
            slot_mapping[offset : offset + len(pos)] = pages[pos // ps] * ps + pos % ps
            offset += len(pos)

        dev = self.device
        as_t = lambda a, dt: torch.as_tensor(a, dtype=dt).to(dev, non_blocking=True)  # noqa: E731
        batch = StepBatch(
            num_decode=sum(1 for n in q_lens if n == 1),
            query_lens=q_lens,
            context_lens=ctx_lens,
            seq_lens=as_t(np.add(ctx_lens, q_lens), torch.int32),
            block_tables=as_t(tables, torch.int32),
            slot_mapping=as_t(slot_mapping, torch.int64),
            state_slots=as_t([it.request.slot for it in items], torch.int32),
            positions=as_t(positions_np, torch.int64),
            prefill_cu_seqlens=as_t(np.concatenate(([0], np.cumsum([n for n in q_lens if n != 1] or [0]))), torch.int32),
        )
        return as_t(ids, torch.int64), batch

    @torch.inference_mode()
    def execute(self, items: list[ScheduledItem]) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling items, vocab], in item order."""
        input_ids, batch = self.prepare(items)
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(input_ids, batch)  # decode-only: every item samples
        hidden = self.model(input_ids, batch, self.kv_pool, self.state_pool, self.kernels)
        last = np.cumsum(batch.query_lens) - 1
        rows = [int(last[i]) for i, it in enumerate(items) if it.samples]
        if not rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[torch.as_tensor(rows, device=hidden.device)])

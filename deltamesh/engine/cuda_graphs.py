"""CUDA graphs: whole decode-only steps (`DecodeGraphs`), and steps with prompt tokens piece by piece
(`PiecewiseGraphs`).

A decode step at batch B is replayed from the graph of the smallest bucket >= B. Inputs are copied into
static buffers; rows past B are padding that points at the scratch KV page and the scratch state slot
(page 0 and slot 0 of the pools), so they never touch a request's state. No host synchronisation happens
inside the graph, so the only sync of a steady-state decode step is reading the sampled tokens.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import torch

from deltamesh.kernels.batch import StepBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # the type of a graph's memory pool (torch names it privately)

log = structlog.get_logger("deltamesh.cuda_graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# A capture fails only on the capturing thread's own unsafe CUDA calls. Under the default ("global") an unsafe call
# of any other thread of the process during a capture (a synchronous copy to the host, say, by another engine's
# threads) invalidates it. vLLM captures in this mode for the same reason (vllm-project/vllm#48053).
CAPTURE_MODE = "thread_local"


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
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (hidden, logits)
        self.pool: _POOL_HANDLE | None = None

    def _batch(self, b: int) -> StepBatch:
        return StepBatch(
            num_decode=b,
            query_lens=[1] * b,
            context_lens=[0] * b,
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            state_slots=self.state_slots[:b],
            positions=self.positions[:b],
        )

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
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                    hidden = r.model(self.input_ids[:b], batch, r.kv_pool, r.state_pool, r.kernels)
                    self.outputs[b] = (hidden, r.model.logits(hidden))
                self.pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.current_stream(r.device).wait_stream(stream)
        log.info("decode graphs captured", buckets=self.buckets, max_context=self.max_pages * r.kv_pool.page_size)

    def fits(self, batch: StepBatch) -> bool:
        return (
            batch.num_decode == batch.num_seqs
            and batch.verify is None  # speculative verification: spec/graphs.py
            and batch.num_seqs <= self.buckets[-1]
            and batch.block_tables.shape[1] <= self.max_pages
        )

    def run(self, input_ids: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [B, hidden], logits [B, vocab]) of a decode-only step (B <= largest bucket)."""
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
        hidden, logits = self.outputs[bucket]
        return hidden[:b], logits[:b]


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token counts a piecewise graph is captured for, up to `max_tokens`: powers of two to 512, then every 256
    tokens to 2048, then every 512 (a step's rows past its tokens are computed too: from a few hundred tokens on
    they cost GPU time)."""
    steps = [16, 32, 64, 128, 256, 512] + list(range(768, 2048, 256)) + list(range(2048, max_tokens, 512))
    return [b for b in steps if b < max_tokens] + [max_tokens]


class PiecewiseGraphs:
    """Steps that carry prompt tokens, replayed from CUDA graphs piece by piece, as vLLM's piecewise graphs: per
    bucket of token counts, the embedding and each layer's `after_mix` (output projection, MLP or MoE, norms: row
    by row) are graphs; each layer's `mix` (its input projection and attention or GDN over the step's sequences,
    whose launches depend on how the tokens split into sequences) runs eagerly between them. A step of T tokens
    replays the smallest bucket >= T. Eager, such a step costs the host ~40-70 ms of launches on the 35B-A3B and
    9B shapes (docs/notes/eager-step-host-cost.md), which a short prompt's GPU work does not cover.

    The pieces read and write only static buffers (ids, the normed layer input `x`, the residual stream, the mix
    outputs: each mixer's pair of [T, heads, dim] tensors), so nothing they allocate outlives them and every piece
    of every bucket shares one memory pool. Rows past T hold what an earlier step left there: finite values whose
    results no real row reads (no piece mixes rows). `capture=False` runs the same pieces as plain calls (the CPU
    tests check the plumbing with it)."""

    def __init__(self, runner, max_tokens: int, capture: bool = True):
        self.runner = runner
        self.buckets = piecewise_buckets(max_tokens)
        model, dev, n = runner.model, runner.device, self.buckets[-1]
        dtype, hidden = model.embed.dtype, model.cfg.hidden_size
        self.shapes = [layer.mixer.mix_shapes for layer in model.layers]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.x = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.mixed = {s: tuple(torch.zeros(n, *row, dtype=dtype, device=dev) for row in s) for s in set(self.shapes)}
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.pool: _POOL_HANDLE | None = None
        if capture:
            self._capture()
        else:
            self.pieces = {b: self._pieces(b) for b in self.buckets}

    def _pieces(self, b: int) -> list[Callable[[], None]]:
        model, kernels = self.runner.model, self.runner.kernels

        def keep(x: torch.Tensor, residual: torch.Tensor) -> None:
            self.x[:b].copy_(x)
            self.residual[:b].copy_(residual)

        def head() -> None:
            keep(*model.head(self.ids[:b], kernels))

        def after_mix(i: int) -> Callable[[], None]:
            mixed = tuple(m[:b] for m in self.mixed[self.shapes[i]])
            return lambda: keep(*model.after_mix(i, mixed, self.residual[:b], kernels))

        return [head] + [after_mix(i) for i in range(len(self.shapes))]

    @torch.inference_mode()
    def _capture(self) -> None:
        dev, start = self.runner.device, time.monotonic()
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                replays = []
                for piece in self._pieces(b):
                    piece()  # warm up: kernel compilation and autotuning stay out of the graph
                    piece()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                        piece()
                    self.pool = graph.pool()
                    replays.append(graph.replay)
                self.pieces[b] = replays
        torch.cuda.current_stream(dev).wait_stream(stream)
        log.info(
            "piecewise graphs captured",
            buckets=self.buckets,
            pieces=len(self.shapes) + 1,
            seconds=round(time.monotonic() - start, 1),
        )

    def fits(self, batch: StepBatch) -> bool:
        return batch.num_tokens <= self.buckets[-1]

    def run(
        self, input_ids: torch.Tensor, batch: StepBatch, between_layers: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (a view of a static buffer: read it before the next step
        runs). `between_layers`: as in HybridLM.forward."""
        r, t = self.runner, input_ids.shape[0]
        model = r.model
        pieces = self.pieces[self.buckets[bisect.bisect_left(self.buckets, t)]]
        self.ids[:t].copy_(input_ids)
        pieces[0]()
        context = model.mix_context(batch, r.state_pool, self.x.dtype)
        for i, shape in enumerate(self.shapes):
            mixed = model.mix(i, self.x[:t], batch, context, r.kv_pool, r.state_pool, r.kernels)
            for static, part in zip(self.mixed[shape], mixed):
                static[:t].copy_(part)
            pieces[i + 1]()
            if between_layers is not None:
                between_layers()
        return self.x[:t]

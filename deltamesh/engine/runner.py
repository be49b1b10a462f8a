"""Turns a scheduled step into model inputs, runs the model, and returns the logits to sample from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltamesh.engine import prompt_logprobs
from deltamesh.engine.cache import KVPagePool, StatePool
from deltamesh.engine.models import HybridLM
from deltamesh.engine.prompt_logprobs import PromptLogprobs, PromptRows
from deltamesh.engine.sampling import on_device
from deltamesh.engine.scheduler import ScheduledItem
from deltamesh.engine.spec import host as spec_host
from deltamesh.engine.spec.host import SpecHost
from deltamesh.kernels import Kernels
from deltamesh.kernels.batch import StateSnapshots, StepBatch

if TYPE_CHECKING:
    from deltamesh.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs
    from deltamesh.engine.spec.runner import SpecRunner
    from deltamesh.engine.tp_workers import Followers

_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


@dataclass
class HostStep:
    """A step's model inputs on the host: what the tensor-parallel leader sends its followers each step."""

    # input ids (a 0 where a pending token goes), sequence lengths, block tables, slot mapping, state slots,
    # positions, prefill chunk offsets, the pending tokens' [2, n] (where in the ids, which sampled row), and the
    # rows of the tokens whose logits are sampled, then the tails' offsets and the snapshots' slots (see below)
    arrays: list[np.ndarray]
    query_lens: list[int]
    context_lens: list[int]
    has_pending: bool
    sample_rows: list[int]  # the tokens whose logits are sampled
    snapshots: int = 0  # the last sequences are this many tails of chunks that keep a state snapshot (host_step)
    spec: SpecHost | None = None  # a speculative engine's step (its arrays follow the others in `arrays`)
    prompt: PromptRows | None = None  # rows whose prompt logprobs requests ask for (prompt_logprobs.py)


class ModelRunner:
    def __init__(
        self, model: HybridLM, kv_pool: KVPagePool, state_pool: StatePool, kernels: Kernels, device: torch.device
    ):
        self.model, self.kv_pool, self.state_pool, self.kernels, self.device = (
            model,
            kv_pool,
            state_pool,
            kernels,
            device,
        )
        self.tp = model.tp  # the tensor-parallel group, or None (one rank, or data-parallel attention)
        self.followers: Followers | None = None  # on a tensor-parallel leader: sent every step
        self.graphs: DecodeGraphs | None = None  # once captured
        self.graph_steps = 0  # steps replayed from them (step_report.py)
        self.pieces: PiecewiseGraphs | None = None  # once captured: steps with prompt tokens
        self.piecewise_steps = 0  # steps replayed from those
        self._page_rows: dict[str, tuple[list[int], np.ndarray]] = {}  # request id -> (pages list, as array)
        self.spec: SpecRunner | None = None  # a speculative engine's (rank.py)
        self._staging: torch.Tensor | None = None  # pinned host buffer of the step's index arrays (CUDA)
        self._staged: torch.cuda.Event | None = None  # recorded after its last copy to the device
        # prompt logprobs: the running step's rows and targets on the device, which `forward` turns into the
        # logprobs the step launcher takes (`take_prompt_logprobs`)
        self._prompt_inputs: tuple[torch.Tensor, torch.Tensor, PromptRows] | None = None
        self._prompt_out: PromptLogprobs | None = None

    def capture_decode_graphs(self, max_batch: int, max_context: int) -> None:
        from deltamesh.engine.cuda_graphs import DecodeGraphs

        if self.spec is not None:  # drafts write a little past a request's length (scheduler.spec_reach)
            max_context += 3 * self.spec.k
        self.graphs = DecodeGraphs(self, max_batch, self.kv_pool.pages_for(max_context))
        self.graphs.capture()
        if self.spec is not None:
            self.spec.capture_graphs(max_batch, self.kv_pool.pages_for(max_context))

    def capture_piecewise_graphs(self, max_tokens: int) -> None:
        from deltamesh.engine.cuda_graphs import PiecewiseGraphs

        self.pieces = PiecewiseGraphs(self, max_tokens)

    def prepare(
        self, items: list[ScheduledItem], pending_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepBatch]:
        """The step's model inputs on the device (see `host_step` and `device_inputs`)."""
        return self.device_inputs(self.host_step(items), pending_tokens)

    def host_step(self, items: list[ScheduledItem], draft: bool = True) -> HostStep:
        """Items must be ordered decode-first (verifying items, then single-token items, then chunks), the items
        that take a checkpoint in passing (`snapshot_at`) last. Each of those runs as two sequences of the step: its
        head, up to the checkpoint, and its tail, placed after every other sequence (the GDN layers run the tails in
        a pass of their own, once the heads' states are kept: models/layers.py). A verifying item (speculative
        decoding) runs as `spec.width` one-token sequences, its last token and its drafts. Vectorised over
        sequences: at batch 256 with 9k-token contexts this is host time on every decode step. `draft`: a
        speculative engine proposes drafts in this step."""
        ps = self.kv_pool.page_size
        nv = sum(it.verify for it in items)  # the leading items
        w = self.spec.width if nv and self.spec is not None else 1  # (only a speculative engine verifies)
        snaps = [it for it in items if it.snapshot_at is not None]
        reqs = [it.request for it in items[:nv] for _ in range(w)] + [it.request for it in items[nv:]]
        reqs += [it.request for it in snaps]
        n = len(reqs)
        computed = np.fromiter((it.request.num_computed for it in items), np.int64, len(items))
        starts = np.concatenate((np.repeat(computed[:nv], w) + np.tile(np.arange(w), nv), computed[nv:]))
        q_lens = np.concatenate((np.ones(nv * w, np.int64), [it.num_tokens for it in items[nv:]])).astype(np.int64)
        # each item's sequence that ends it (a verifying item's last row, a snapshot item's tail)
        last_seq = np.concatenate(((np.arange(nv) + 1) * w - 1, nv * w + np.arange(len(items) - nv))).astype(np.int64)
        if snaps:
            first = len(starts) - len(snaps)  # the snapshot items' rows: their heads
            at = np.fromiter((it.snapshot_at for it in snaps), np.int64, len(snaps))
            tails = starts[first:] + q_lens[first:] - at
            q_lens[first:] = at - starts[first:]
            starts, q_lens = np.concatenate((starts, at)), np.concatenate((q_lens, tails))
            last_seq[len(items) - len(snaps) :] = np.arange(first + len(snaps), n)
        self._page_rows = rows = {r.request_id: self._page_row(r) for r in reqs}
        if self.spec is None:
            page_counts = -(-(starts + q_lens) // ps)
        else:  # drafts and a step launched before the last one's accepted tokens were read go past the lengths
            page_counts = np.fromiter((len(rows[r.request_id][1]) for r in reqs), np.int64, n)
        tables = np.full((n, int(page_counts.max())), -1, dtype=np.int32)
        for row, (r, count) in enumerate(zip(reqs, page_counts)):
            tables[row, :count] = rows[r.request_id][1][:count]
        seq_of_token = np.repeat(np.arange(n), q_lens)
        first_token = np.cumsum(q_lens) - q_lens
        positions = np.arange(int(q_lens.sum())) - first_token[seq_of_token] + starts[seq_of_token]
        slot_mapping = tables[seq_of_token, positions // ps].astype(np.int64) * ps + positions % ps
        ids: list[int] = []
        fill_at, fill_from = [], []  # where in `ids` a pending token goes, and its row in `pending_tokens`
        for seq, (r, s, q) in enumerate(zip(reqs, starts.tolist(), q_lens.tolist())):
            if seq < nv * w and seq % w:  # a draft (one the device holds is filled there: SpecRunner)
                ids.append(r.draft_ids[seq % w - 1] if len(r.draft_ids) >= seq % w else 0)
                continue
            ids += r.ids_between(s, s + q)
            if r.num_pending and s + q > r.num_tokens - r.num_pending:
                fill_at.append(len(ids))
                fill_from.append(r.pending_row)
                ids.append(0)  # a placeholder, overwritten on the device

        q_list = q_lens.tolist()
        prefill_lens = [q for q in q_list[nv * w :] if q != 1] or [0]
        last = np.cumsum(q_lens) - 1
        sample_rows = [row for i in range(nv) for row in range(i * w, (i + 1) * w)]
        sample_rows += [int(last[last_seq[i]]) for i, it in enumerate(items) if i >= nv and it.samples]
        prefill_cu = np.concatenate(([0], np.cumsum(prefill_lens))).astype(np.int32)
        tail_cu = np.concatenate(([0], np.cumsum(q_list[len(q_list) - len(snaps) :]))).astype(np.int32)
        spec = None
        if self.spec is not None:
            spec = spec_host.build(items, reqs, starts, q_lens, last_seq, nv, w, draft)
        prompt = prompt_logprobs.host_rows(items, nv, w, starts, q_lens, last_seq)
        return HostStep(
            arrays=[
                np.asarray(ids, dtype=np.int64),
                (starts + q_lens).astype(np.int32),
                tables,
                slot_mapping,
                np.fromiter((r.slot for r in reqs), np.int32, n),
                positions,
                prefill_cu,
                np.asarray([fill_at, fill_from], dtype=np.int64).reshape(2, -1),
                np.asarray(sample_rows, dtype=np.int64),
                tail_cu,
                np.fromiter((it.snapshot_slot for it in snaps), np.int64, len(snaps)),  # index_copy_ wants int64
                *(spec.arrays if spec is not None else []),
            ],
            query_lens=q_list,
            context_lens=starts.tolist(),
            has_pending=bool(fill_at),
            sample_rows=sample_rows,
            snapshots=len(snaps),
            spec=spec,
            prompt=prompt,
        )

    def device_inputs(self, step: HostStep, pending_tokens: torch.Tensor | None) -> tuple[torch.Tensor, StepBatch]:
        """An item whose last input is still pending (sampled by the step before, not yet on the host) takes it
        from `pending_tokens[request.pending_row]`, on the device. A tensor-parallel follower has no pending
        tokens: it receives the leader's filled input ids."""
        arrays = self._upload(step.arrays)
        ids_t, seq_lens, tables_t, slot_mapping_t, slots, positions_t, cu_seqlens, fill, sample_index, tail_cu, kept = (
            arrays[:11]
        )
        if step.has_pending:
            if pending_tokens is not None:
                ids_t[fill[0]] = pending_tokens[fill[1]]
                if step.spec is not None:
                    assert self.spec is not None, "a step with drafts comes from a speculative engine"
                    self.spec.fill_drafts(step.spec, arrays[11:], ids_t)
            elif self.tp is None or self.tp.shard.rank == 0:
                raise ValueError("a scheduled token is pending but no previous step's tokens were given")
            if self.tp is not None:
                self.tp.broadcast(ids_t)
        q_list = step.query_lens
        batch = StepBatch(
            num_decode=sum(q == 1 for q in q_list),
            query_lens=q_list,
            context_lens=step.context_lens,
            seq_lens=seq_lens,
            block_tables=tables_t,
            slot_mapping=slot_mapping_t,
            state_slots=slots,
            positions=positions_t,
            prefill_cu_seqlens=cu_seqlens,
            sample_index=sample_index,
            snapshot=StateSnapshots(step.snapshots, tail_cu, kept) if step.snapshots else None,
        )
        if step.spec is not None:
            assert self.spec is not None, "a step with drafts comes from a speculative engine"
            batch.verify = self.spec.place(step.spec, arrays[11:], batch)
        return ids_t, batch

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The step's index arrays on the device. On CUDA they travel in one copy from a pinned staging
        buffer: one pageable copy per array costs tens of microseconds of host time each, every step."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            # 16-byte aligned: Triton specializes a pointer argument by whether it is, so with less each kernel
            # reading these arrays would compile again for each alignment the step's earlier arrays' sizes give
            total += -(-a.nbytes // 16) * 16
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
        elif self._staged is not None:
            self._staged.synchronize()  # the previous step's copy has left the buffer (it was queued first in
            # that step, behind a step whose tokens have been read, so this rarely waits)
        host = self._staging.numpy()
        for a, off in zip(arrays, offsets):
            host[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        device = self._staging[:total].to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return [
            device[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)
        ]

    def _page_row(self, req) -> tuple[list[int], np.ndarray]:
        """(the request's page list, its pages as an array), extended from the last step's array when the
        list only grew in place since (see Request.pages), rebuilt when the list was replaced."""
        cached = self._page_rows.get(req.request_id)
        if cached is not None and cached[0] is req.pages:
            known = cached[1]
            if len(known) == len(req.pages):
                return cached
            if len(known) < len(req.pages):
                return req.pages, np.concatenate((known, np.asarray(req.pages[len(known) :], dtype=np.int64)))
        return req.pages, np.asarray(req.pages, dtype=np.int64)

    @torch.inference_mode()
    def execute(
        self,
        items: list[ScheduledItem],
        pending_tokens: torch.Tensor | None = None,
        between_layers: Callable[[], None] | None = None,
        sampling=None,
    ):
        """Run one step; returns float32 logits [num sampling items, vocab], in item order. `pending_tokens`:
        the previous step's sampled tokens, on the device (see `device_inputs`). `between_layers`: called after
        each layer is queued (not in a decode step replayed from a CUDA graph, which is one launch). A speculative
        engine returns its spec.runner.SpecOutputs instead, its tokens accepted as `sampling` (SpecSampling) says."""
        step = self.host_step(items, draft=sampling is None or sampling.draft)
        if self.followers is not None:
            self.followers.send_step(step)
        return self.run(step, pending_tokens, between_layers, sampling)

    def forward(
        self, input_ids: torch.Tensor, batch: StepBatch, between_layers: Callable[[], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, logits of every row or None): a decode-only step replayed from a CUDA graph (which gives
        its logits too), a step with prompt tokens from piecewise graphs, or the model run eagerly. Then the step's
        prompt logprobs, if its requests ask for some."""
        logits = None
        if self.graphs is not None and self.graphs.fits(batch):
            self.graph_steps += 1
            hidden, logits = self.graphs.run(input_ids, batch)  # decode-only: every item samples
        elif self.pieces is not None and self.pieces.fits(batch):
            self.piecewise_steps += 1
            hidden = self.pieces.run(input_ids, batch, between_layers)
        else:
            hidden = self.model(input_ids, batch, self.kv_pool, self.state_pool, self.kernels, between_layers)
        if self._prompt_inputs is not None:
            rows, targets, host = self._prompt_inputs
            self._prompt_inputs = None
            vocab = self.model.cfg.vocab_size
            self._prompt_out = PromptLogprobs(self.model.logits, vocab, hidden, rows, targets, host)
        return hidden, logits

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The last forward pass's prompt logprobs (once)."""
        out, self._prompt_out = self._prompt_out, None
        return out

    @torch.inference_mode()
    def idle(self) -> torch.Tensor:
        """A data-parallel rank's step when it has no requests in it: its part in the other ranks' MoE layers."""
        self.model.idle(self.kernels)
        return torch.empty((0, self.model.cfg.vocab_size), dtype=torch.float32, device=self.device)

    @torch.inference_mode()
    def run(
        self,
        step: HostStep,
        pending_tokens: torch.Tensor | None = None,
        between_layers: Callable[[], None] | None = None,
        sampling=None,
    ):
        """`execute` from the host inputs: what every tensor-parallel rank runs for the leader's step."""
        input_ids, batch = self.device_inputs(step, pending_tokens)
        self._prompt_out, self._prompt_inputs = None, None  # (a follower never takes its own)
        if (p := step.prompt) is not None:
            self._prompt_inputs = (
                on_device(p.rows, torch.int64, self.device),
                on_device(p.targets, torch.int64, self.device),
                p,
            )
        if step.spec is not None:
            assert self.spec is not None, "a step with drafts comes from a speculative engine"
            return self.spec.run(step.spec, input_ids, batch, sampling, between_layers)
        hidden, logits = self.forward(input_ids, batch, between_layers)
        if logits is not None:
            return logits
        if not step.sample_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[batch.sample_index])

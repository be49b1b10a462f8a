"""Where drafts come from: the MTP module (`MtpDrafter`), or any other source with the same face (`Drafter`: tests
use one that proposes a known continuation).

A drafter runs after the step's tokens are accepted and the GDN states committed. The MTP drafter first runs the
MTP layer over every token the step computed (`catch-up`): position p reads the target's hidden state there and
the token at p+1 (a prompt's next token, the token sampled after its last one, or for a verifying request its next
draft, the accepted run ending in the new token), which writes the MTP's own KV at those positions: its attention
then always sees the whole sequence, prompt included, as vLLM's and SGLang's MTP drafters do. The KV it wrote past
a request's accepted tokens lies beyond its length and is overwritten by the next step's catch-up. Then, for each
request that samples, it drafts K tokens from its last accepted position: the first from the catch-up's output
there, each further one from one more MTP step over one row per request (chained on the MTP's own hidden state),
greedily (the acceptance treats a draft as a point mass: spec/accept.py): the argmax over the whole vocabulary, or
over a reduced draft vocabulary's hot ids when one is set (spec/draft_vocab.py, --speculative-draft-vocab).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deltamesh.kernels.batch import StepBatch

if TYPE_CHECKING:
    from deltamesh.engine.cache import KVPagePool
    from deltamesh.engine.models import HybridLM
    from deltamesh.engine.spec.draft_vocab import DraftHead
    from deltamesh.kernels import Kernels


@dataclass
class DraftContext:
    """What a drafter may read after a step's acceptance (device tensors unless said)."""

    model: HybridLM
    kv_pool: KVPagePool
    kernels: Kernels
    ids: torch.Tensor  # [T] the step's input tokens
    hidden: torch.Tensor  # [T, hidden] the target's normed hidden states
    batch: StepBatch
    next_ids: torch.Tensor  # [T] the token after each input (module docstring)
    last_rows: torch.Tensor  # [R] each sampling request's last accepted input's token row
    next_tokens: torch.Tensor  # [R] its new last token (not yet an input)
    tables: torch.Tensor  # [R, pages] its block table
    k: int  # drafts per request
    draft: bool  # False: the step backed off, only the MTP's KV is kept up
    requests: list | None = None  # the leader's sampling requests (host), for drafters that need them


class Drafter:
    """Proposes `k` tokens after each sampling request's new last token: [R, k] int64, or None when it proposes
    nothing this step (the next step then verifies placeholders, which are as exact, only never accepted)."""

    def draft(self, ctx: DraftContext) -> torch.Tensor | None:
        raise NotImplementedError


class MtpDrafter(Drafter):
    def __init__(self, head: DraftHead | None = None):
        """`head`: the reduced draft vocabulary's LM head rows; None: draft over the whole vocabulary."""
        self.head = head

    def _argmax(self, model: HybridLM, h: torch.Tensor) -> torch.Tensor:
        return self.head.argmax(h) if self.head is not None else model.logits(h).argmax(-1)

    def draft(self, ctx: DraftContext) -> torch.Tensor | None:
        model = ctx.model
        mtp = model.mtp
        assert mtp is not None, "a speculative engine's model has its MTP module"
        g = mtp(model, ctx.next_ids, ctx.hidden, ctx.batch, ctx.kv_pool, ctx.kernels)
        r = ctx.last_rows.shape[0]
        if not ctx.draft or not r:
            return None
        h = g[ctx.last_rows]
        token = self._argmax(model, h)
        drafts = [token]
        position = ctx.batch.positions[ctx.last_rows]
        page = ctx.kv_pool.page_size
        for step in range(1, ctx.k):
            at = position + step  # the position of the token drafted last
            batch = StepBatch(
                num_decode=r,
                query_lens=[1] * r,
                context_lens=[0] * r,  # exact on the device only
                seq_lens=(at + 1).to(torch.int32),
                block_tables=ctx.tables,
                slot_mapping=ctx.tables.gather(1, (at // page)[:, None]).squeeze(1).long() * page + at % page,
                state_slots=torch.zeros(r, dtype=torch.int32, device=at.device),
                positions=at,
                decode_lengths_on_device=True,
            )
            h = mtp(model, token, h, batch, ctx.kv_pool, ctx.kernels, step)
            token = self._argmax(model, h)
            drafts.append(token)
        return torch.stack(drafts, 1)

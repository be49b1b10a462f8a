"""A test-only draft source (engine/spec/drafter.py's face): it proposes each request's known continuation, so
verification accepts every draft, or a wrong token at a chosen output index, so it rejects there and the GDN
state and KV roll back to the accepted prefix."""

from __future__ import annotations

import torch

from deltamesh.engine.spec.drafter import DraftContext, Drafter


class ReferenceDrafter(Drafter):
    def __init__(self, references: dict[str, list[int]], vocab: int, wrong_at: int | None = None):
        """`references`: request id -> its prompt and the continuation the target produces; `wrong_at`: the output
        index whose draft is replaced by another token."""
        self.references, self.vocab, self.wrong_at = references, vocab, wrong_at
        self.calls = 0

    def draft(self, ctx: DraftContext) -> torch.Tensor | None:
        if not ctx.draft or not ctx.requests:
            return None
        self.calls += 1
        seqs = [self.references[r.request_id] for r in ctx.requests]
        longest = max(map(len, seqs))
        table = torch.tensor([s + [0] * (longest - len(s)) for s in seqs], device=ctx.ids.device)
        # the new last token sits one past the last accepted input; draft j (from 1) one past that, and so on
        at = ctx.batch.positions[ctx.last_rows][:, None] + 2 + torch.arange(ctx.k, device=ctx.ids.device)
        drafts = table.gather(1, at.clamp(max=longest - 1))
        if self.wrong_at is not None:
            prompt = torch.tensor([len(r.prompt_ids) for r in ctx.requests], device=at.device)
            wrong = at - prompt[:, None] == self.wrong_at
            drafts = torch.where(wrong, (drafts + 1) % self.vocab, drafts)
        return drafts

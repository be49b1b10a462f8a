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


def prefill_then_decode(prefill, decode, requests: list, check=None) -> dict[str, list[int]]:
    """P/D without a transport: `requests` [(request id, prompt, params)] run on `prefill` to their first token
    and held; each held state's bytes, region for region, its first token and its drafts then start the request on
    `decode`, stepped until every one ends. `check(request id, drafts, held regions, reserved regions)` sees each
    hand-off before it is made. Returns each request's tokens (the first one included)."""
    results: dict[str, list[int]] = {}
    finals: dict[str, object] = {}

    def sink(out):
        results.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            finals[out.request_id] = out

    held_requests = [prefill.make_request(prompt, params, rid, hold_state=True) for rid, prompt, params in requests]
    for req in held_requests:
        prefill.submit(req, sink)
    while len(prefill.held) < len(requests):
        prefill.dispatch(prefill.process_commands())
        prefill.dispatch(prefill.step())
    finals.clear()  # a held request ends on the prefill engine after its first token
    for req in held_requests:  # the prompts as token ids (a text prompt is tokenised by make_request)
        rid, prompt, params = req.request_id, req.prompt_ids, req.params
        held, drafts = prefill.held.regions(rid), prefill.held.drafts(rid)
        res = decode.reservations.reserve(len(prompt))
        if check is not None:
            check(rid, drafts, held, res.regions)
        for dst, src in zip(res.regions, held):
            dst.tensor.copy_(src.tensor)
        assert prefill.held.release(rid)
        decode.submit_transferred(decode.make_request(prompt, params, rid), results[rid][0], res, sink, drafts)
    while len(finals) < len(requests):
        decode.dispatch(decode.process_commands())
        decode.dispatch(decode.step())
    return results

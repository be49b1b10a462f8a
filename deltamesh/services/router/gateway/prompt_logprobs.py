"""The prompt's logprobs in REST answers, as vLLM gives them: `prompt_logprobs` (per prompt token, {token id: its
logprob, rank and text} for the token and the k most likely there; the first token's null), and completions' legacy
`logprobs` rows, which with `echo` start with the prompt's tokens (the first one's logprob null): what lm-eval's
loglikelihood tasks read (`echo`, `logprobs=1`, `max_tokens` 0 or 1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deltamesh.services.router import openai_schema as oa
from deltamesh.v1 import common_pb2

# a row of completions' legacy logprobs: (token id, its logprob, the most likely there as (token id, logprob));
# logprob and top None for an echoed prompt's first token
Row = tuple[int, float | None, Sequence[tuple[int, float]] | None]


def vllm_prompt_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], token_text: Callable[[int], str]
) -> oa.PromptLogprobs:
    out: oa.PromptLogprobs = [None]
    for lp in entries:
        entry = {
            str(lp.token_id): oa.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=token_text(lp.token_id))
        }
        for rank, top in enumerate(lp.top, start=1):
            key = str(top.token_id)
            if key not in entry:
                entry[key] = oa.PromptLogprob(logprob=top.logprob, rank=rank, decoded_token=token_text(top.token_id))
        out.append(entry)
    return out


def prompt_rows(prompt_ids: list[int], entries: Sequence[common_pb2.TokenLogprob], k: int) -> list[Row]:
    """An echoed prompt's rows: its first token's without a logprob, then each next one's with its k most likely."""
    rows: list[Row] = [(prompt_ids[0], None, None)]
    rows += [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top[:k]]) for lp in entries]
    return rows


def output_rows(items: Sequence[common_pb2.TokenLogprob]) -> list[Row]:
    return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in items]


def legacy_logprobs(rows: list[Row], offset: int, token_text: Callable[[int], str]) -> oa.CompletionLogprobs:
    """Completions' logprobs of `rows`, their text offsets counted from `offset`. Each row's top dict has the token
    first, then the k most likely (as vLLM's: the token may be one of them; a text another token repeats keeps the
    first's logprob)."""
    tokens = [token_text(token) for token, _, _ in rows]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops: list[dict[str, float] | None] = []
    for text, (_, logprob, top) in zip(tokens, rows):
        if logprob is None:
            tops.append(None)
            continue
        entry = {text: logprob}
        for token, value in top or ():
            entry.setdefault(token_text(token), value)
        tops.append(entry)
    return oa.CompletionLogprobs(
        tokens=tokens, token_logprobs=[logprob for _, logprob, _ in rows], text_offset=offsets, top_logprobs=tops
    )

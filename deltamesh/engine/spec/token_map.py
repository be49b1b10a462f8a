"""A measured token map for the reduced draft head (spec/draft_vocab.py; `--speculative-draft-vocab FILE`): the N
token ids that occur most often in text like the served traffic, as FR-Spec builds its maps and SGLang ships them
(`--speculative-token-map`, a torch-saved 1-D tensor of ids). "The N lowest ids" is only a proxy: a BPE vocabulary's
low ids are its byte tokens and first merges, not the words a model writes most.

Every added (special) token of the tokenizer is in the map whatever the text: end of turn, thinking and tool-call
markers are what a model emits at its turns' edges, and a token outside the map is never drafted. The rest are the
most frequent tokens of the text (ties to the lower id); a text with fewer distinct tokens gives a smaller map.
`deltamesh token-map` (services/token_map_command.py) writes one."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from deltamesh.engine.tokenizer import Tokenizer

BATCH_TEXTS = 512  # texts per encode_batch call (tokenizers encodes a batch on all cores)


@dataclass
class TokenMap:
    ids: torch.Tensor  # sorted int64 token ids
    counted: int  # tokens of text counted
    distinct: int  # distinct token ids among them
    coverage: float  # the fraction of the counted tokens that are in the map

    def save(self, path: Path) -> None:
        """`.json`: a list of ids; anything else: SGLang's format, a torch-saved int64 tensor."""
        if path.suffix == ".json":
            path.write_text(json.dumps(self.ids.tolist()) + "\n")
        else:
            torch.save(self.ids.clone(), path)


def texts_of(path: Path) -> Iterator[str]:
    """The text of a file: `.jsonl` (a JSON value per line) and `.json`: every string value in it, at any depth
    (prompts, completions, chat messages' contents, whatever the dataset calls them; keys are not text); any other
    file: its text, a paragraph at a time."""
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            documents = (json.loads(line) for line in f if line.strip()) if path.suffix == ".jsonl" else [json.load(f)]
            for document in documents:
                yield from _strings(document)
        return
    with path.open(encoding="utf-8") as f:
        paragraph: list[str] = []
        for line in f:
            paragraph.append(line)
            if not line.strip():
                yield "".join(paragraph)
                paragraph = []
        if paragraph:
            yield "".join(paragraph)


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def count_tokens(tokenizer: Tokenizer, texts: Iterable[str]) -> torch.Tensor:
    """How often each token id occurs in `texts` (no special tokens added), int64 [vocab_size]."""
    counts = torch.zeros(tokenizer.vocab_size, dtype=torch.int64)
    batch: list[str] = []

    def flush() -> None:
        ids = [i for encoded in tokenizer.encode_batch(batch, add_special_tokens=False) for i in encoded]
        if ids:
            counts.add_(torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=len(counts)))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == BATCH_TEXTS:
            flush()
    flush()
    return counts


def frequent_token_map(tokenizer: Tokenizer, counts: torch.Tensor, size: int) -> TokenMap:
    """The map of at most `size` ids: the tokenizer's added tokens first, then the most frequent of `counts`."""
    vocab = len(counts)
    if not 1 <= size <= vocab:
        raise ValueError(f"a token map's size must be in [1, {vocab}] (the vocabulary), got {size}")
    special = sorted({i for i in tokenizer.backend.get_added_tokens_decoder() if i < vocab})
    if len(special) > size:
        raise ValueError(
            f"the tokenizer has {len(special)} added tokens, more than a map of {size}: give a larger size"
        )
    chosen = torch.zeros(vocab, dtype=torch.bool)
    chosen[special] = True
    by_count = torch.argsort(-counts, stable=True)  # ties: the lower id first
    seen = by_count[counts[by_count] > 0]
    frequent = seen[~chosen[seen]][: size - len(special)]
    chosen[frequent] = True
    counted = int(counts.sum())
    return TokenMap(
        ids=chosen.nonzero().flatten(),
        counted=counted,
        distinct=int((counts > 0).sum()),
        coverage=float(counts[chosen].sum()) / counted if counted else 0.0,
    )

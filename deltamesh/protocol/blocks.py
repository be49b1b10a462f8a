"""The names of prompt blocks: a key per page-sized block of tokens, chained through its prefix. The engine's prefix
cache keys its pages by them, and the router's cache-aware policy names what it sent each worker the same way."""

from __future__ import annotations


def block_key(parent: int | None, tokens) -> int:
    """The key of a token block after the prefix whose last block's key is `parent` (None: the first block).
    Python's hash of a tuple of ints is the same in every process (no hash seed applies to ints)."""
    return hash((parent, tuple(tokens)))

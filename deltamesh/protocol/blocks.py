"""The names of prompt blocks: a key per page-sized block of tokens, chained through its prefix. The engine's prefix
cache keys its pages by them, its workers publish the keys of what they cache to the routers, and the routers'
cache-aware policy names prompts the same way: a key must be the same in every process."""

from __future__ import annotations

# The parent of a prompt's first block. Not None: before Python 3.12 hash(None) is None's address, which differs
# from process to process, so a chain begun from None named the same prompt differently in each process.
ROOT = 0


def block_key(parent: int | None, tokens) -> int:
    """The key of a token block after the prefix whose last block's key is `parent` (None: the first block).
    Python's hash of a tuple of ints is the same in every process (no hash seed applies to ints)."""
    return hash((ROOT if parent is None else parent, tuple(tokens)))


def block_keys(ids, block: int) -> list[int]:
    """The keys of every whole `block`-token block of `ids`, first to last."""
    keys, parent = [], None
    for i in range(len(ids) // block):
        parent = block_key(parent, ids[i * block : (i + 1) * block])
        keys.append(parent)
    return keys

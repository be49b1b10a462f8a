"""The shape of one forward step, as every kernel sees it.

A step runs a flat batch of tokens from several sequences. Sequences are ordered decode-first: the first
`num_decode` sequences contribute exactly one token each, the rest are prefill chunks (of any length,
possibly continuing an earlier chunk). Host-side lists are kept next to the device tensors so that CPU
code never has to synchronise to learn a length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the engine's pools import the kernels: named for type checkers only
    from deltamesh.engine.cache import StatePool


@dataclass
class StateSnapshots:
    """The step's last `count` sequences are tails: each continues a chunk of the same step (an earlier sequence,
    its head) that ends at a prefix-cache checkpoint. The GDN layers run everything but the tails, keep each head's
    state in its snapshot slot, then run the tails from their heads' states."""

    count: int
    tail_cu_seqlens: torch.Tensor  # [count+1] int32 the tails' offsets among themselves (device)
    slots: torch.Tensor  # [count] int64 the state slot each tail's head state is kept in (device)


@dataclass
class Verification:
    """Speculative decoding (engine/spec/): the step's first `count * width` tokens are `count` sequences of `width`
    tokens each (a request's last token and its drafts). Attention sees them as one-token decode rows, each with
    its own length; the GDN layers as sequences, each run from its request's state with the state after every token
    kept in the draft pool (`pool`, slots `slots`), the request's own state left for the caller to commit."""

    count: int
    width: int
    pool: StatePool  # the draft states
    slots: torch.Tensor  # [count, width] int64 the draft-pool slot of each token's state (device)

    @property
    def num_tokens(self) -> int:
        return self.count * self.width


@dataclass
class StepBatch:
    num_decode: int  # leading sequences with a single query token
    query_lens: list[int]  # tokens this step, per sequence
    context_lens: list[int]  # tokens already cached before this step, per sequence
    seq_lens: torch.Tensor  # [N] int32 context + query (device)
    block_tables: torch.Tensor  # [N, max_pages] int32 KV page ids, -1 padded (device)
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot (page * page_size + offset) per token (device)
    state_slots: torch.Tensor  # [N] int32 GDN state slot per sequence (device)
    positions: torch.Tensor  # [T] int64 absolute position per token (device)
    prefill_cu_seqlens: torch.Tensor | None = None  # [Np+1] int32 offsets of the prefill chunks (device)
    sample_index: torch.Tensor | None = None  # [S] int64 the tokens whose logits are sampled (device)
    snapshot: StateSnapshots | None = None
    verify: Verification | None = None  # the leading decode rows that verify drafts
    # the decode rows' lengths are exact only on the device (seq_lens): a speculative step launched before the
    # previous one's accepted tokens were known moves its rows on by them there; kernels that read host lengths
    # read these rows' from seq_lens
    decode_lengths_on_device: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

"""The host side of a speculative step: what the leader knows when it launches the step (runner.host_step builds
it; a tensor-parallel leader sends it to its followers with the rest of the step), and what the device then
works out from the previous step's outputs (runner.SpecRunner)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SpecHost:
    """A step of a speculative engine. Its first `num_verify * width` tokens are the verifying requests' inputs,
    each request's `width` in a row (its last token, then its drafts): one-token decode rows for attention."""

    width: int  # K + 1, or 1 when no request verifies in this step
    num_verify: int
    # [num_verify] the previous step's row of each verifying request whose inputs are still on the device (its
    # last step has not been read: async scheduling), -1 where the host put them in the step's ids
    source_rows: np.ndarray
    # [2, n] (token row, previous step's row) of every decode row whose request's last step has not been read: the
    # drafts that step accepted move the row on (its position, length and KV slot), on the device
    moves: np.ndarray
    sample_rows: np.ndarray  # [R] the token row of each sampling request's first new input (verifying ones first)
    sample_seqs: np.ndarray  # [R] its sequence (row of the block tables)
    next_fix: np.ndarray  # [2, n] (token row, token): sequence ends whose next token the host knows (prompts)
    draft: bool  # propose drafts for the next step (False: a step backed off at a large batch)

    @property
    def arrays(self) -> list[np.ndarray]:
        """What the device reads of it (uploaded with the step's other index arrays)."""
        return [self.source_rows, self.moves, self.sample_rows, self.sample_seqs, self.next_fix]


def build(
    items,
    reqs: list,
    starts: np.ndarray,
    q_lens: np.ndarray,
    last_seq: np.ndarray,
    num_verify: int,
    width: int,
    draft: bool,
) -> SpecHost:
    """`reqs`, `starts`, `q_lens`: the step's sequences (a verifying item's `width` rows first); `last_seq`: each
    item's last sequence."""
    end_rows = np.cumsum(q_lens) - 1
    sampling = [i for i, it in enumerate(items) if it.samples]
    sample_seqs = np.asarray([i * width if i < num_verify else last_seq[i] for i in sampling], dtype=np.int64).reshape(
        -1
    )
    sample_rows = np.where(np.arange(len(sampling)) < num_verify, sample_seqs, end_rows[sample_seqs])
    source_rows = np.fromiter(
        (it.request.pending_row if it.request.num_pending else -1 for it in items[:num_verify]), np.int64, num_verify
    )
    move_rows: list[int] = []
    move_from: list[int] = []
    for i, it in enumerate(items):
        if not (it.verify or it.num_tokens == 1):
            break  # decode items lead, verifying ones first
        if it.request.num_pending:
            first, count = (i * width, width) if i < num_verify else (num_verify * width + i - num_verify, 1)
            move_rows += range(first, first + count)
            move_from += [it.request.pending_row] * count
    moves = np.asarray([move_rows, move_from], dtype=np.int64).reshape(2, -1)
    sampled_ends = set(last_seq[sampling].tolist())
    fix_rows, fix_tokens = [], []
    for seq in range(num_verify * width, len(reqs)):
        if seq in sampled_ends:
            continue  # the token sampled there comes next (on the device)
        end = int(starts[seq] + q_lens[seq])
        fix_rows.append(int(end_rows[seq]))
        fix_tokens += reqs[seq].ids_between(end, end + 1)
    next_fix = np.asarray([fix_rows, fix_tokens], dtype=np.int64).reshape(2, -1)
    return SpecHost(width, num_verify, source_rows, moves, sample_rows.astype(np.int64), sample_seqs, next_fix, draft)

"""bench/gpu_moe.py's verify rows route consecutive tokens to overlapping experts: each row's top-k keeps exactly
the asked number of the previous row's experts, and its other choices are new."""

import pytest
import torch

from bench.gpu_moe import overlapping_logits


@pytest.mark.parametrize("kept", [0, 4, 6, 8])
def test_each_row_keeps_the_asked_share_of_the_previous_rows_experts(kept):
    logits = overlapping_logits(4, 256, 8, kept, torch.Generator().manual_seed(kept))
    top = [set(row.tolist()) for row in torch.topk(logits, 8, dim=-1).indices]
    assert all(len(row) == 8 for row in top)
    assert [len(top[i] & top[i - 1]) for i in range(1, 4)] == [kept] * 3

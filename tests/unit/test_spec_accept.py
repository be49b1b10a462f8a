"""Acceptance of drafted tokens (engine/spec/accept.py): greedy keeps exactly the target's own tokens; speculative
sampling keeps the target's distribution exactly (chi-square tests at a stated significance, fixed seeds); the run
stops at a stop token or the token budget."""

import numpy as np
import pytest
import torch

from deltamesh.engine.sampling import SamplingParams
from deltamesh.engine.spec.accept import AcceptInputs, accept

pytestmark = pytest.mark.spec
ALPHA = 1e-3  # each chi-square test fails a correct sampler once in a thousand seeds; the seeds here are fixed


def inputs(params, stops=None, budget=None):
    r = len(params)
    return AcceptInputs(
        params,
        [0] * r,
        np.asarray(stops if stops is not None else [[-1]] * r, dtype=np.int64),
        np.asarray(budget if budget is not None else [100] * r, dtype=np.int64),
    )


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic) for X chi-square with (support - 1) degrees of freedom, over the support of `probs`."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was produced"
    n = counts.sum()
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_greedy_keeps_the_prefix_the_target_agrees_with_and_adds_its_next_token():
    # target argmax per position: 3, 1, 4, 2; drafts agree on the first two only
    logits = torch.full((1, 4, 6), -5.0)
    for j, tok in enumerate([3, 1, 4, 2]):
        logits[0, j, tok] = 5.0
    out = accept(logits, torch.tensor([[3, 1, 5]]), [3], inputs([SamplingParams(temperature=0)]), None)
    assert out.counts.tolist() == [3] and out.tokens[0, :3].tolist() == [3, 1, 4]
    assert out.next_tokens.tolist() == [4] and out.done.tolist() == [False]
    all_kept = accept(logits, torch.tensor([[3, 1, 4]]), [3], inputs([SamplingParams(temperature=0)]), None)
    assert all_kept.tokens[0].tolist() == [3, 1, 4, 2] and all_kept.counts.tolist() == [4]
    no_drafts = accept(logits, torch.tensor([[3, 1, 4]]), [0], inputs([SamplingParams(temperature=0)]), None)
    assert no_drafts.counts.tolist() == [1] and no_drafts.next_tokens.tolist() == [3]


def test_the_run_stops_at_a_stop_token_and_at_the_budget():
    logits = torch.full((2, 4, 6), -5.0)
    for j, tok in enumerate([3, 1, 4, 2]):
        logits[:, j, tok] = 5.0
    drafts = torch.tensor([[3, 1, 4], [3, 1, 4]])
    greedy = [SamplingParams(temperature=0)] * 2
    out = accept(logits, drafts, [3, 3], inputs(greedy, stops=[[1, -1], [-1, -1]], budget=[100, 3]), None)
    assert out.counts.tolist() == [2, 3]  # stopped at token 1; the budget allows 3 new tokens
    assert out.next_tokens.tolist() == [1, 4] and out.done.tolist() == [True, True]
    # the device knows of outputs the host has not read: they count against the budget
    moved = accept(logits, drafts, [3, 3], inputs(greedy, budget=[100, 3]), torch.tensor([0, 1]))
    assert moved.counts.tolist() == [4, 2]


def target_and_drafts(seed, v=6, w=3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(w, v, generator=gen) * 1.5
    drafts = logits[:-1].argmax(-1)  # a good drafter's proposals (the target's mode), as an MTP head's
    return logits, drafts


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4), SamplingParams(top_p=0.8, min_p=0.05)],
)
def test_speculative_sampling_keeps_the_target_distribution(params):
    """Every output token, at each position given the tokens before it, follows the target's (filtered)
    distribution, whether the drafts were accepted, rejected or (the last) sampled after all were kept."""
    from deltamesh.engine.sampling import _filter

    logits, drafts = target_and_drafts(seed=11)
    n = 60000
    out = accept(
        logits.expand(n, -1, -1).contiguous(),
        drafts.expand(n, -1).contiguous(),
        [2] * n,
        inputs([params] * n),
        None,
        torch.Generator().manual_seed(0),
    )
    probs = _filter(logits, [params] * 3)
    tokens, counts = out.tokens, out.counts
    first = torch.bincount(tokens[:, 0], minlength=6)
    assert chi_square_p_value(first, probs[0]) > ALPHA
    after_first = (tokens[:, 0] == drafts[0]) & (counts >= 2)
    assert after_first.sum() == (tokens[:, 0] == drafts[0]).sum()  # an accepted draft is always followed
    second = torch.bincount(tokens[after_first, 1], minlength=6)
    assert chi_square_p_value(second, probs[1]) > ALPHA
    after_second = after_first & (tokens[:, 1] == drafts[1])
    third = torch.bincount(tokens[after_second, 2], minlength=6)
    assert chi_square_p_value(third, probs[2]) > ALPHA
    assert (counts == 3).sum() == after_second.sum()


def test_a_badly_drafted_token_is_rejected_as_often_as_the_target_gives_it_no_mass():
    logits, _ = target_and_drafts(seed=3)
    unlikely = logits[0].argmin()
    n = 40000
    out = accept(
        logits.expand(n, -1, -1).contiguous(),
        torch.stack([unlikely, unlikely]).expand(n, -1).contiguous(),
        [2] * n,
        inputs([SamplingParams(temperature=1.0)] * n),
        None,
        torch.Generator().manual_seed(9),
    )
    p = torch.softmax(logits[0], -1)
    first = torch.bincount(out.tokens[:, 0], minlength=6)
    assert chi_square_p_value(first, p) > ALPHA
    kept = (out.counts >= 2).float().mean().item()
    assert abs(kept - p[unlikely].item()) < 5 * (p[unlikely].item() / n) ** 0.5 + 1e-3


def test_a_seeded_request_draws_the_same_tokens_again():
    logits, drafts = target_and_drafts(seed=4)
    params = [SamplingParams(temperature=1.0, seed=42)] * 8
    runs = [
        accept(
            logits.expand(8, -1, -1).contiguous(),
            drafts.expand(8, -1).contiguous(),
            [2] * 8,
            inputs(params),
            None,
            torch.Generator().manual_seed(g),
        ).tokens
        for g in (1, 2)
    ]
    assert torch.equal(runs[0], runs[1])

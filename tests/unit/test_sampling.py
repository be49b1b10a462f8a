import pytest
import torch

from deltamesh.engine.sampling import SamplingParams, sample


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    lg = logits()
    p = SamplingParams(temperature=0, logprobs=3)
    tokens, lps = sample(lg, [p] * 4, [0] * 4)
    assert tokens == lg.argmax(-1).tolist()
    ref = torch.log_softmax(lg, -1)
    for row, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(ref[row, tokens[row]].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == ref[row].topk(3).indices.tolist()


def test_seeded_sampling_depends_only_on_seed_and_position():
    lg = logits(1)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = [sample(lg, [p], [i])[0][0] for i in range(30)]
    b = [sample(lg, [p], [i], torch.Generator().manual_seed(99))[0][0] for i in range(30)]
    assert a == b
    assert len(set(a)) > 1  # positions differ, so draws differ


def test_top_k_top_p_min_p_restrict_the_support():
    lg = logits(1, seed=5)
    order = lg[0].argsort(descending=True).tolist()
    draws = lambda p: {sample(lg, [p], [i])[0][0] for i in range(200)}  # noqa: E731
    assert draws(SamplingParams(top_k=3, seed=1)) <= set(order[:3])
    probs = lg[0].softmax(-1)[order]
    keep = int((probs.cumsum(0) < 0.5).sum()) + 1
    assert draws(SamplingParams(top_p=0.5, seed=2)) <= set(order[:keep])
    allowed = set(torch.nonzero(lg[0].softmax(-1) >= 0.2 * lg[0].softmax(-1).max()).flatten().tolist())
    assert draws(SamplingParams(min_p=0.2, seed=3)) <= allowed


def test_sampling_follows_the_distribution():
    lg = torch.tensor([[0.0, 1.0, 2.0]])
    p = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(lg, [p], [0], gen)[0][0] for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, lg[0].softmax(-1), atol=0.03)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=2),
        dict(stop=[""]),
        dict(stop_token_ids=[999]),
        dict(logprobs=21),
        dict(seed=-1),
        # bounds of the wire types, booleans and floats as integers, lone surrogates (security review)
        dict(max_tokens=2**32),
        dict(top_k=2**32),
        dict(seed=2**64),
        dict(seed=10**400),
        dict(max_tokens=True),
        dict(stop_token_ids=[True]),
        dict(stop_token_ids=[2.0]),
        dict(logprobs=False),
        dict(stop=["a\ud800"]),
        dict(stop_token_ids=[1] * 1025),
    ],
)
def test_invalid_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_integer_bounds_follow_the_wire_types():
    """seed is a uint64 on the wire: every value of [0, 2**64) is accepted, and taken as is."""
    for kwargs in (
        dict(seed=0),
        dict(seed=2**63),
        dict(seed=2**64 - 1),
        dict(top_k=2**32 - 1),
        dict(max_tokens=2**32 - 1),
        dict(stop=["\U0001f600"]),
    ):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_invalid_messages_say_what_to_send_without_echoing_huge_values():
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 18446744073709551615\], got int 1000"):
        SamplingParams(seed=10**400).validate(vocab_size=100)
    with pytest.raises(ValueError, match="lone surrogate at character 1"):
        SamplingParams(stop=["a\ud800"]).validate(vocab_size=100)

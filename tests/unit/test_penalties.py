"""The logits stage (engine/penalties.py) on its own: the adjusted logits against a float64 reference written from
the definitions (tests/penalty_reference.py), step after step while the host lags a step behind the device (async
scheduling: a step's tokens are counted on the device before the host knows them), through a preemption (rows given
up, then rebuilt from the host's ids) and with a finished request still in the batch; nothing run and nothing
allocated for requests that do not ask; rows only for what a request uses."""

import pytest
import torch
from penalty_reference import reference_logits

from deltamesh.engine.penalties import LogitAdjustments, VerifyRows
from deltamesh.engine.request import Request, Status
from deltamesh.protocol.sampling import SamplingParams

V = 64
EOS = frozenset({0, 1})


def request(rid: str, params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Request:
    req = Request(rid, list(prompt), params, None, EOS)
    req.output_ids, req.status = list(output), Status.RUNNING
    return req


def mixed() -> list[Request]:
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, V, (n,), generator=gen).tolist()

    return [
        request("rep", SamplingParams(repetition_penalty=1.3), ids(20)),
        request("plain", SamplingParams(), ids(5)),
        request("openai", SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4), ids(9)),
        request("bias", SamplingParams(logit_bias={3: 5.5, 7: -100.0, 11: 0.25}), ids(3)),
        request("min", SamplingParams(min_tokens=3, stop_token_ids=[5, 1]), ids(4)),
        request("min-ignore-eos", SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[9]), ids(4)),
        # arrived from a prefill worker with its first token; everything at once, a repetition penalty below 1
        request(
            "all",
            SamplingParams(
                repetition_penalty=0.8,
                presence_penalty=1.5,
                frequency_penalty=2.0,
                logit_bias={0: 3.0, 2: -1.0},
                min_tokens=4,
                logprobs=2,
            ),
            ids(30),
            output=[4],
        ),
    ]


def assert_matches(adjusted: torch.Tensor, raw: torch.Tensor, reqs: list[Request], outputs: dict[str, list[int]]):
    for row, req in enumerate(reqs):
        want = reference_logits(raw[row], req.prompt_ids, outputs[req.request_id], req.params, EOS)
        got = adjusted[row].double()
        assert torch.equal(torch.isinf(got), torch.isinf(want)), req.request_id
        finite = ~torch.isinf(want)
        assert torch.allclose(got[finite], want[finite], atol=1e-5), req.request_id


def test_adjusted_logits_follow_the_definitions_while_the_host_lags_and_through_a_preemption():
    adj = LogitAdjustments(V, torch.device("cpu"))
    reqs = mixed()
    outputs = {r.request_id: list(r.output_ids) for r in reqs}  # the true output so far (the device's view)
    gen = torch.Generator().manual_seed(1)
    unread: dict[str, int] = {}  # each request's last token, not yet on the host
    for step in range(9):
        if step == 4:  # "rep" is preempted: its rows go at the next step, and come back once it runs again
            reqs[0].status = Status.WAITING
        running = [r for r in reqs if r.status is Status.RUNNING]
        raw = torch.randn(len(running), V, generator=gen) * 4
        kept = raw.clone()
        adjusted, counting = adj.apply(raw, running)
        assert torch.equal(raw, kept), "logprobs are read from the logits as they came (a request asks for them)"
        assert_matches(adjusted, raw, running, outputs)
        tokens = torch.multinomial(adjusted.softmax(-1), 1, generator=gen).squeeze(1)
        adj.count(counting, tokens)
        # the host reads the step's tokens only after the next step is launched
        for req in reqs:
            if req.request_id in unread:
                req.output_ids.append(unread.pop(req.request_id))
                req.num_pending -= 1
        for req, token in zip(running, tokens.tolist()):
            outputs[req.request_id].append(token)
            unread[req.request_id] = token
            req.num_pending += 1
        if step == 5:
            assert adj.rows_in_use == len(reqs) - 2  # "rep" gave its rows up; "plain" never had any
        if step == 6:  # "rep" runs again: re-admitted once its pending token reached the host (the scheduler's rule)
            assert reqs[0].num_pending == 0 and reqs[0].output_ids == outputs["rep"]
            reqs[0].status = Status.RUNNING
    assert all(len(outputs[r.request_id]) > r.params.min_tokens for r in reqs)


def test_a_finished_request_still_in_the_batch_is_left_alone_and_its_rows_freed():
    """A request can end while the step that samples it again is being launched (async scheduling): its token
    there is dropped, so its logits are not adjusted and its rows go back."""
    adj = LogitAdjustments(V, torch.device("cpu"))
    reqs = mixed()
    adj.count(adj.apply(torch.randn(len(reqs), V), reqs)[1], torch.zeros(len(reqs), dtype=torch.int64))
    assert adj.rows_in_use == len(reqs) - 1
    reqs[2].status = Status.FINISHED
    raw = torch.randn(len(reqs), V)
    adjusted, _ = adj.apply(raw, reqs)
    assert torch.equal(adjusted[2], raw[2]) and adj.rows_in_use == len(reqs) - 2


def test_requests_that_do_not_adjust_their_logits_cost_nothing():
    adj = LogitAdjustments(V, torch.device("cpu"))
    plain = [request(f"p{i}", SamplingParams(temperature=0.5, logprobs=1, top_k=-1), [1, 2, 3]) for i in range(4)]
    raw = torch.randn(4, V)
    adjusted, counting = adj.apply(raw, plain)
    assert adjusted is raw and counting is None
    assert adj._sparse is None and adj._counted is None  # no device memory either
    # logit_bias and min_tokens take a small row only: the [vocab] counts are for penalties
    adj.apply(raw, [request("b", SamplingParams(logit_bias={1: 1.0}, min_tokens=2), [1])] + plain[:3])
    assert adj._sparse is not None and adj._counted is None


def test_the_counts_pool_grows_and_reuses_the_rows_of_finished_requests():
    adj = LogitAdjustments(V, torch.device("cpu"))
    first = [request(f"a{i}", SamplingParams(frequency_penalty=1.0), [i]) for i in range(10)]
    adj.apply(torch.randn(10, V), first)
    grown = adj._counted.capacity
    assert grown >= 10
    for req in first:
        req.status = Status.FINISHED
    second = [request(f"b{i}", SamplingParams(presence_penalty=1.0), [i, i + 1]) for i in range(10)]
    raw = torch.randn(10, V)
    adjusted, _ = adj.apply(raw, second)
    assert adj._counted.capacity == grown and adj.rows_in_use == 10
    assert_matches(adjusted, raw, second, {r.request_id: [] for r in second})  # nothing left from the old rows


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(repetition_penalty=0),
        dict(repetition_penalty=-1.0),
        dict(repetition_penalty=float("inf")),
        dict(repetition_penalty=float("nan")),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-2.01),
        dict(frequency_penalty=float("nan")),
        dict(logit_bias={400: 1.0}),  # out of the vocabulary
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={1: 100.5}),
        dict(logit_bias={1: float("nan")}),
        dict(logit_bias={True: 1.0}),
        dict(logit_bias={i: 1.0 for i in range(301)}),
        dict(min_tokens=-1),
        dict(min_tokens=17),  # over max_tokens (16 by default)
        dict(min_tokens=2**32),
        dict(top_k=-2),
    ],
)
def test_out_of_range_values_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate(vocab_size=400)


def test_verified_positions_see_the_drafts_before_them_and_only_emitted_tokens_are_counted():
    """A verify step's logits: K+1 rows per verifying request (position j after its drafts 1..j, counted as
    generated there), one row per other request; after acceptance only the emitted tokens (a run of accepted
    drafts and one more, or a single row's token) are counted, so the next step follows the definitions again."""
    k, w = 3, 4
    adj = LogitAdjustments(V, torch.device("cpu"))
    reqs = [mixed()[i] for i in (4, 6, 0, 3, 1, 2, 5)]  # min_tokens and every penalty among the verifying ones
    outputs = {r.request_id: list(r.output_ids) for r in reqs}
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        n = 4 if step % 2 == 0 else 0  # steps with and without verification; the first n requests verify
        verifying, single = reqs[:n], reqs[n:]
        # drafts that repeat a token, so counts of 2 inside a run show
        drafts = torch.randint(0, V, (n, k), generator=gen)
        if n:
            drafts[:, 1] = drafts[:, 0]
        raw = torch.randn(n * w + len(single), V, generator=gen) * 4
        kept = raw.clone()
        adjusted, counting = adj.apply(raw, reqs, VerifyRows(n, w, drafts))
        assert torch.equal(raw, kept)
        for i, req in enumerate(verifying):
            for j in range(w):
                seen = outputs[req.request_id] + drafts[i, :j].tolist()
                assert_matches(adjusted[i * w + j][None], raw[i * w + j][None], [req], {req.request_id: seen})
        assert_matches(adjusted[n * w :], raw[n * w :], single, outputs)
        # each verifying request emits a run of its drafts and one more token; the others one token
        emitted = torch.tensor([i % w + 1 for i in range(n)] + [1] * len(single))
        new = torch.randint(0, V, (len(reqs), w), generator=gen)
        if n:
            new[:n, : w - 1] = drafts
        adj.count(counting, new, emitted)
        for req, row, m in zip(reqs, new.tolist(), emitted.tolist()):
            outputs[req.request_id] += row[:m]
            req.output_ids = list(outputs[req.request_id])  # the host read the step (no async lag here)

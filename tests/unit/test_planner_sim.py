"""The planner's simulation (deltamesh/planner/simulator.py) against cases worked out by hand: deterministic
schedules whose every first token and last token can be written down, an M/D/1 queue (Pollaczek-Khinchine), a
prompt's interference with a running decode (colocated) and its absence (prefill/decode), preemption; and the
traffic, SLA and profile inputs refusing what they cannot use."""

import json
import math

import pytest

from deltamesh.planner.layouts import Layout, Role
from deltamesh.planner.metrics import summarize
from deltamesh.planner.profile import (
    DecodeGrid,
    MemoryModel,
    PrefillModel,
    Profile,
    ProfileError,
    TransferModel,
)
from deltamesh.planner.simulator import SimulationError, simulate
from deltamesh.planner.traffic import LengthDist, Sla, Traffic


def synthetic(
    per_token_ms=1.0,
    step_ms=0.0,
    decode=((1, 0, 10.0),),
    mixed_extra_ms=0.0,
    transfer=((1, 5.0),),
    kv_tokens=1 << 20,
    page_size=16,
    gpus=1,
    name="synthetic",
) -> Profile:
    """A profile of round numbers: a prompt chunk costs step_ms + per_token_ms per token, a decode step 10 ms."""
    return Profile(
        name=name,
        gpus_per_worker=gpus,
        parallelism={"tensor_parallel_size": gpus},
        model={"path": "models/m", "name": "m", "load_format": "dummy"},
        engine={"device": "cuda", "dtype": "bfloat16", "prefix_cache": True},
        memory=MemoryModel(page_size, 1, 0, 0, fixed_kv_budget_bytes=kv_tokens, prefix_cache=False),
        prefill=PrefillModel(step_ms, per_token_ms, 0.0),
        decode=DecodeGrid([list(p) for p in decode]),
        mixed_extra_ms=mixed_extra_ms,
        transfer=TransferModel([list(p) for p in transfer]),
    )


def colocated(profile, workers=1, seqs=64, budget=4096, max_len=4096):
    return Layout(max_len, colocated=Role(profile, workers, seqs, budget))


def disaggregated(profile, x=1, y=1, seqs=64, budget=4096, max_len=4096):
    return Layout(max_len, prefill=Role(profile, x, seqs, budget), decode=Role(profile, y, seqs, budget))


def even(rate, n, prompt, output):
    """n requests, one every 1/rate seconds (the first at 1/rate)."""
    return Traffic(
        LengthDist.parse(str(prompt)),
        LengthDist.parse(str(output)),
        request_rate=rate,
        num_requests=n,
        burstiness=math.inf,
    )


def ms(seconds):
    return round(seconds * 1e3, 6)


def test_requests_far_apart_see_exactly_their_own_steps():
    # 100-token prompt at 1 ms/token: one 100 ms step; then 4 decode steps of 10 ms; the next request comes 1 s later
    result = simulate(colocated(synthetic()), even(1.0, 5, 100, 5))
    for i, r in enumerate(result.requests):
        assert ms(r.sent) == 1000 * (i + 1)
        assert ms(r.first_token - r.sent) == 100
        assert ms(r.finished - r.sent) == 140
    s = summarize(result, Sla(ttft_p50_ms=101, tpot_p50_ms=10.1))
    assert s["ttft_p50_ms"] == pytest.approx(100) and s["tpot_p50_ms"] == pytest.approx(10)
    assert s["meets_sla"] and s["good_requests"] == 5
    assert s["duration_s"] == pytest.approx(5.14)
    assert s["tok_s"] == pytest.approx(5 * 105 / 5.14)


def test_prompts_wait_for_the_step_budget_one_by_one():
    # budget = one prompt per step: three prompts sent together get their first tokens after 1, 2 and 3 steps
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("1"), concurrency=3, num_requests=3)
    result = simulate(colocated(synthetic(), budget=100), traffic)
    assert [ms(r.first_token) for r in result.requests] == [100, 200, 300]
    # a budget of 150 splits the second prompt: the first 100 + its first 50, then its last 50 + the third's 100
    result = simulate(colocated(synthetic(), budget=150), traffic)
    assert [ms(r.first_token) for r in result.requests] == [150, 300, 300]


def test_closed_loop_sends_the_next_request_when_one_ends():
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("3"), concurrency=1, num_requests=3)
    result = simulate(colocated(synthetic()), traffic)
    # each: 100 ms prompt + 2 decode steps of 10 ms; the next is sent at the end of the one before
    assert [ms(r.sent) for r in result.requests] == [0, 120, 240]
    assert [ms(r.finished) for r in result.requests] == [120, 240, 360]


def test_the_serving_path_delays_a_request_each_way():
    # 5 ms each way: the request reaches its worker at 5, its 100 ms prompt ends at 105, the client sees the first
    # token at 110; two decode steps end at 125, seen at 130, when the closed loop sends the next request
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("3"), concurrency=1, num_requests=2)
    a, b = simulate(colocated(synthetic()), traffic, path_ms=5.0).requests
    assert ms(a.first_token) == 110 and ms(a.finished) == 130
    assert ms(b.sent) == 130 and ms(b.first_token) == 240 and ms(b.finished) == 260
    s = summarize(simulate(colocated(synthetic()), traffic, path_ms=5.0), Sla())
    assert s["ttft_p50_ms"] == pytest.approx(110) and s["tpot_p50_ms"] == pytest.approx(10)


def test_requests_sent_together_reach_an_idle_worker_one_by_one():
    # three prompts sent together pass the router 5 ms apart: the first reaches the idle worker at 5 and is
    # stepped alone [5, 105]; the other two (at 10 and 15) wait and go together [105, 305] (budget 4096)
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("1"), concurrency=3, num_requests=3)
    result = simulate(colocated(synthetic()), traffic, path_ms=5.0)
    assert [ms(r.first_token) for r in result.requests] == [110, 310, 310]
    # without the path the three share the first step
    result = simulate(colocated(synthetic()), traffic)
    assert [ms(r.first_token) for r in result.requests] == [300, 300, 300]


def test_a_closed_loop_next_request_misses_the_step_that_follows_an_end():
    # 1 ms each way, two streams: A (100-token prompt, 1 token) reaches the worker at 1 and is stepped alone
    # [1, 101]; B (10-token prompt, 4 tokens) at 2. A's end is seen at 102, when its successor C is sent; C reaches
    # the worker at 103, after B's prompt step [101, 111] began: C's prompt goes beside B's first decode
    # [111, 221], then B decodes alone [221, 231], [231, 241]
    class Fixed(Traffic):
        def requests(self):
            return [(None, 100, 1), (None, 10, 4), (None, 100, 1)]

    traffic = Fixed(LengthDist.parse("100"), LengthDist.parse("1"), concurrency=2, num_requests=3)
    a, b, c = simulate(colocated(synthetic()), traffic, path_ms=1.0).requests
    assert ms(a.first_token) == 102 and ms(a.finished) == 102
    assert ms(c.sent) == 102 and ms(c.first_token) == 222
    assert ms(b.first_token) == 112 and ms(b.finished) == 242


def test_the_serving_path_cannot_be_negative():
    with pytest.raises(ValueError, match="serving path"):
        simulate(colocated(synthetic()), even(1.0, 1, 10, 2), path_ms=-1.0)


def test_a_prompt_stalls_a_running_decode_colocated_not_disaggregated():
    # A (100-token prompt, 3 tokens) at 1 s, B (100-token prompt, 1 token) at 1.105 s
    a_then_b = [(1.0, 100, 3), (1.105, 100, 1)]

    class Fixed(Traffic):
        def requests(self):
            return a_then_b

    traffic = Fixed(LengthDist.parse("100"), LengthDist.parse("3"), request_rate=1.0, num_requests=2)
    # colocated: A's prompt [1.0, 1.1], A's decode [1.1, 1.11], then A's decode beside B's prompt: 10 + 100 ms
    a, b = simulate(colocated(synthetic()), traffic).requests
    assert ms(a.first_token) == 1100 and ms(a.finished) == 1220 and ms(b.first_token) == 1220
    assert (a.finished - a.first_token) / 2 * 1e3 == pytest.approx(60)  # TPOT 60 ms: B's prompt inside
    # 1P1D: A pulled in 5 ms, decodes 2 steps of 10 ms; B prefills on the prefill worker alone
    a, b = simulate(disaggregated(synthetic()), traffic).requests
    assert ms(a.first_token) == 1100 and ms(a.finished) == 1125 and ms(b.first_token) == 1205
    # a mixed step's measured extra counts once per mixed step
    a, b = simulate(colocated(synthetic(mixed_extra_ms=7.0)), traffic).requests
    assert ms(a.finished) == 1227


def test_workers_on_one_gpu_take_turns_on_it():
    # the case above, 1P1D with both workers on one GPU: A's prompt [1.0, 1.1] alone, pulled at 1.105, when B's
    # prompt starts too; while both run each goes at half speed: A's two 10 ms decode steps end at 1.125 and
    # 1.145 (B has 80 ms of its 100 left), then B alone to 1.225
    class Fixed(Traffic):
        def requests(self):
            return [(1.0, 100, 3), (1.105, 100, 1)]

    traffic = Fixed(LengthDist.parse("100"), LengthDist.parse("3"), request_rate=1.0, num_requests=2)
    p = synthetic()
    layout = Layout(4096, prefill=Role(p, 1, 64, 4096), decode=Role(p, 1, 64, 4096), one_gpu=True)
    a, b = simulate(layout, traffic).requests
    assert ms(a.first_token) == 1100 and ms(a.finished) == 1145 and ms(b.first_token) == 1225
    assert layout.gpus == 1 and layout.label == "1P1D on one GPU"
    # a worker alone on the GPU runs at full speed: the same as on a GPU of its own
    alone = Fixed(LengthDist.parse("100"), LengthDist.parse("3"), request_rate=1.0, num_requests=1)
    alone.requests = lambda: [(1.0, 100, 3)]  # type: ignore[method-assign]
    (a,) = simulate(layout, alone).requests
    assert ms(a.first_token) == 1100 and ms(a.finished) == 1125


def test_a_worker_pool_given_in_tokens_bounds_the_batch_and_the_router_admits_what_it_holds():
    # two prompts prefilled in one 200 ms step, both pulled at 205 and decoded together (4 steps of 10 ms); a decode
    # pool of 112 tokens (7 pages) holds one request of 100 + 5 tokens: the router admits the second only when the
    # first ends, before its prefill (as services/router/admission.py does); the first prefills alone (100 ms),
    # pulled at 105, ends at 145; the second prefills from 145, pulled at 250, ends at 290
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("5"), concurrency=2, num_requests=2)
    p = synthetic()
    for kv_tokens, ends in ((None, [245, 245]), (112, [145, 290])):
        layout = Layout(4096, prefill=Role(p, 1, 64, 4096), decode=Role(p, 1, 64, 4096, kv_tokens=kv_tokens))
        assert [ms(r.finished) for r in simulate(layout, traffic).requests] == ends


def test_disaggregated_hand_off_holds_the_prefill_slot_until_the_pull():
    # 1P1D, prefill worker of one slot: the second prompt (sent with the first) waits until the first's state
    # is pulled (5 ms after its first token), then prefills 100 ms
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("5"), concurrency=2, num_requests=2)
    layout = Layout(4096, prefill=Role(synthetic(), 1, 1, 4096), decode=Role(synthetic(), 1, 64, 4096))
    a, b = simulate(layout, traffic).requests
    assert ms(a.first_token) == 100 and ms(b.first_token) == 205
    # a: pulled at 105, 4 decode steps of 10 ms; b: first token 205, pulled 210, its 4 steps after
    assert ms(a.finished) == 145 and ms(b.finished) == 250


def test_md1_queue_waits_as_pollaczek_khinchine():
    # one prompt per step (budget = prompt), 1 output token: each request is one service of D = 100 ms, FIFO, one
    # server; Poisson arrivals at rho = 0.5 -> mean wait rho D / (2 (1 - rho)) = 50 ms, P(no wait) = 1 - rho
    rate, d = 5.0, 0.1
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("1"), request_rate=rate, num_requests=40_000, seed=7)
    result = simulate(colocated(synthetic(), budget=100), traffic)
    waits = [r.first_token - r.sent - d for r in result.requests]
    rho = rate * d
    assert sum(waits) / len(waits) == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.05)
    assert sum(w < 1e-9 for w in waits) / len(waits) == pytest.approx(1 - rho, abs=0.01)


def test_a_short_kv_pool_preempts_and_recomputes():
    # a pool of 4 pages of 16 tokens: two requests of 30-token prompts and 20 outputs cannot both grow to 50 tokens
    profile = synthetic(kv_tokens=64, per_token_ms=0.1)
    traffic = Traffic(LengthDist.parse("30"), LengthDist.parse("20"), concurrency=2, num_requests=2)
    result = simulate(colocated(profile, max_len=64), traffic)
    assert result.preemptions >= 1
    assert all(r.finished > 0 for r in result.requests)  # both end: the preempted one is recomputed


def test_a_request_larger_than_the_pool_is_refused_before_running():
    with pytest.raises(SimulationError, match="does not fit"):
        simulate(colocated(synthetic(kv_tokens=64), max_len=4096), even(1.0, 2, 100, 5))


@pytest.mark.parametrize(
    "spec",
    ["0", "-3", "uniform:5:2", "normal:100", "gamma:1:2", "lognormal:0:1", "uniform:a:b", "file:/nonexistent/x"],
)
def test_length_distributions_refuse_what_they_cannot_draw(spec):
    with pytest.raises(ValueError, match="length distribution"):
        LengthDist.parse(spec)


def test_length_distributions_draw_their_shape():
    import numpy as np

    rng = np.random.default_rng(0)
    assert set(LengthDist.parse("uniform:10:12").sample(rng, 500).tolist()) == {10, 11, 12}
    normal = LengthDist.parse("normal:1000:100").sample(rng, 5000)
    assert abs(normal.mean() - 1000) < 10 and 90 < normal.std() < 110
    assert LengthDist.parse("lognormal:1:3").sample(rng, 100).min() >= 1


def test_traffic_and_sla_refuse_bad_values():
    one = LengthDist.parse("1")
    for kwargs in ({}, {"request_rate": 1.0, "concurrency": 2}, {"request_rate": 0.0}, {"concurrency": 0}):
        with pytest.raises(ValueError):
            Traffic(one, one, **kwargs)
    with pytest.raises(ValueError, match="TTFT|ttft"):
        Sla(ttft_p50_ms=-1)


def test_profile_files_are_checked(tmp_path):
    good = synthetic().to_json()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good))
    assert Profile.load(path).decode.ms(1, 0) == 10.0
    for broken, match in (
        ({**good, "format": "other"}, "not a deltamesh profile"),
        ({**good, "version": 99}, "version"),
        ({k: v for k, v in good.items() if k != "prefill"}, "missing or malformed"),
        ({**good, "prefill": {"step_ms": -1, "ms_per_token": 1, "ms_per_mpair": 0}}, "non-negative"),
    ):
        path.write_text(json.dumps(broken))
        with pytest.raises(ProfileError, match=match):
            Profile.load(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="No such file"):
        Profile.load(tmp_path / "absent.json")


def test_step_model_interpolates_the_decode_grid_and_adds_chunks():
    p = synthetic(
        decode=((1, 1000, 5.0), (64, 1000, 12.0), (1, 9000, 6.0), (64, 9000, 20.0)),
        step_ms=3.0,
        per_token_ms=0.01,
        mixed_extra_ms=-4.0,
    )
    assert p.decode.ms(1, 1000) == 5.0 and p.decode.ms(64, 9000) == 20.0
    assert p.decode.ms(32.5, 5000) == pytest.approx((8.5 + 13.0) / 2)
    assert p.decode.ms(128, 1000) == pytest.approx(5.0 + 7.0 * 127 / 63)  # extended along the last segment
    assert p.step_ms(0, 0, 1000, 0) == pytest.approx(13.0)
    assert p.step_ms(64, 1000, 1000, 0) == pytest.approx(12.0 + 10.0 - 4.0)
    assert p.step_ms(64, 1000, 100, 0) == pytest.approx(12.0)  # never less than the decodes alone


def test_decode_stretches_run_exactly_as_step_by_step(monkeypatch):
    # the simulator takes a batch of decodes alone as one event until something can change it; stepping one step
    # at a time must give the same times to the last bit that matters (preemptions included)
    from deltamesh.planner.simulator import Worker

    profile = synthetic(decode=((1, 0, 5.0), (64, 0, 12.0), (1, 8000, 6.0), (64, 8000, 20.0)), per_token_ms=0.03)
    cases = [
        (colocated(profile, 2), "uniform:100:3000", "uniform:10:400", {"request_rate": 3.0}),
        (disaggregated(profile, 1, 2, seqs=16), "uniform:100:3000", "uniform:10:400", {"concurrency": 24}),
        (
            colocated(synthetic(kv_tokens=2048), 1, 16, 512, 2048),
            "uniform:100:900",
            "uniform:10:900",
            {"concurrency": 8},
        ),
    ]
    real = Worker._stretch
    for layout, prompts, outputs, load in cases:
        traffic = Traffic(LengthDist.parse(prompts), LengthDist.parse(outputs), num_requests=120, seed=3, **load)
        taken = []
        with monkeypatch.context() as m:
            m.setattr(Worker, "_stretch", lambda self, *args: taken.append(real(self, *args)) or taken[-1])
            stretched = simulate(layout, traffic)
        assert max(steps for steps, _ in taken) > 1  # stretches were taken
        with monkeypatch.context() as m:
            m.setattr(Worker, "_stretch", lambda self, items, context, first: (1, first))
            stepped = simulate(layout, traffic)
        assert stretched.steps == stepped.steps and stretched.preemptions == stepped.preemptions
        for a, b in zip(stretched.requests, stepped.requests):
            assert a.first_token == pytest.approx(b.first_token, abs=1e-9)
            assert a.finished == pytest.approx(b.finished, abs=1e-9)
    assert stretched.preemptions > 0  # the last case runs short of KV pages


def test_the_router_admits_to_the_least_loaded_decode_worker_with_a_free_slot_first_come_first_served():
    # 1P2D, decode workers of one slot each, prefill of 10 ms a prompt (100 tokens), 4 steps of 10 ms to decode:
    # three requests at once: a and b admitted at 0 (one to each decode worker), prefilled together (200 ms), pulled
    # at 205, end at 245; c waits at the router until then, prefills alone (100 ms), first token 345, ends 390
    traffic = Traffic(LengthDist.parse("100"), LengthDist.parse("5"), concurrency=3, num_requests=3)
    p = synthetic()
    layout = Layout(4096, prefill=Role(p, 1, 64, 4096), decode=Role(p, 2, 1, 4096))
    a, b, c = simulate(layout, traffic).requests
    assert [ms(r.first_token) for r in (a, b, c)] == [200, 200, 345]
    assert [ms(r.finished) for r in (a, b, c)] == [245, 245, 390]


def test_a_one_token_prompt_ends_its_prefill_and_decodes_on_the_decode_worker():
    # 1P1D: a 1-token prompt is one 1 ms prefill step (like a decode in the step model: 10 ms here), never a run of
    # decode steps on the prefill worker; pulled in 5 ms, its other 4 tokens on the decode worker
    traffic = Traffic(LengthDist.parse("1"), LengthDist.parse("5"), concurrency=1, num_requests=1)
    result = simulate(disaggregated(synthetic()), traffic)
    (a,) = result.requests
    assert ms(a.first_token) == 10 and ms(a.finished) == 55
    with pytest.raises(SimulationError, match="needs a worker and a slot"):
        simulate(Layout(4096, prefill=Role(synthetic(), 1, 64, 4096), decode=Role(synthetic(), 1, 0, 4096)), traffic)

"""bench/serve_metrics.wave_ttfts: a closed-loop point's first tokens split into its first wave and the requests
sent as earlier ones ended (the rows of bench/peers.py and bench/disagg_sweep.py carry it)."""

import pytest

from bench.serve_metrics import wave_ttfts


def test_the_first_wave_is_the_first_concurrency_sends_in_time_order():
    # issue order is not send order: the later sends are those after the first `concurrency` in time
    starts = [5.0, 0.0, 0.0, 7.0, 0.0]
    ttfts = [0.3, 1.0, 2.0, 0.5, 3.0]
    got = wave_ttfts(starts, ttfts, concurrency=3)
    assert got == pytest.approx(
        {"ttft_wave1_median_ms": 2000.0, "ttft_later_median_ms": 400.0, "later_sends_span_s": 2.0}
    )


def test_failed_requests_and_a_single_wave():
    got = wave_ttfts([0.0, 0.0, None, 0.0], [0.1, 0.2, 0.0, 0.0], concurrency=2)
    assert abs(got["ttft_wave1_median_ms"] - 150.0) < 1e-9
    assert got["ttft_later_median_ms"] is None and got["later_sends_span_s"] is None

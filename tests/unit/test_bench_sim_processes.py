"""bench/sim_processes.py's pure parts: how the simulation's workers and streams are shared out over processes, and
how the load processes' results merge into one row (bench/router_sim.py --worker-processes, --client-processes)."""

import pytest

from bench.sim_load import LoadResult
from bench.sim_processes import merge_results, shares


@pytest.mark.parametrize(
    ("total", "parts", "expected"), [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (1, 3, [1, 0, 0])]
)
def test_shares_cover_the_total_as_evenly_as_whole_numbers_allow(total, parts, expected):
    assert shares(total, parts) == expected
    assert sum(shares(total, parts)) == total


def test_shares_refuse_no_parts():
    with pytest.raises(ValueError):
        shares(4, 0)


def test_merged_results_sum_the_counts_and_keep_the_longest_run():
    a = LoadResult(streams=10, tokens=160, errors=["UNAVAILABLE: x"], wrong=1, seconds=5.0, cpu_s=1.5)
    b = LoadResult(streams=12, tokens=192, errors=[], wrong=0, seconds=5.4, cpu_s=2.0)
    c = LoadResult(streams=3, tokens=48, errors=["HTTP 500: y", "HTTP 503: z"], wrong=2, seconds=4.9, cpu_s=0.5)
    merged = merge_results([a, b, c])
    assert (merged.streams, merged.tokens, merged.wrong) == (25, 400, 3)
    assert merged.errors == ["UNAVAILABLE: x", "HTTP 500: y", "HTTP 503: z"]
    # side by side, not one after the other: the rate is all tokens over the longest process's seconds
    assert merged.seconds == 5.4
    assert merged.cpu_s == pytest.approx(4.0)


def test_one_result_merges_to_itself():
    a = LoadResult(streams=2, tokens=32, errors=[], wrong=0, seconds=1.25, cpu_s=0.25)
    assert merge_results([a]) == a

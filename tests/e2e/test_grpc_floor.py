"""bench/grpc_floor.py at a tiny scale: a sender and a receiver process on loopback for each shape, the tokens
counted as the shape carries them (one a message per request, or one per request in each step's message). No
timing assertions."""

import pytest
from harness import bench_rows

pytestmark = pytest.mark.e2e

STREAMS = 4


def test_each_shape_streams_its_tokens_in_its_messages(tmp_path):
    args = ["--streams", str(STREAMS), "--step-rates", "200", "--seconds", "1", "--warmup", "0.5"]
    rows = {row["shape"]: row for row in bench_rows("grpc_floor.py", args, tmp_path / "floor.json", timeout=120)}
    assert set(rows) == {"per-request", "multiplexed", "multiplexed-demux"}
    for row in rows.values():
        assert row["errors"] == [] and row["tokens"] > 0, row
    assert rows["per-request"]["tokens"] == rows["per-request"]["messages"]
    # one message a step, a token of every request in it
    assert rows["multiplexed"]["tokens"] == STREAMS * rows["multiplexed"]["messages"]
    # handed on through the requests' queues: the window may fall between a message and its tokens' hand-off (a few
    # steps under load); losing concurrent additions would show as a quarter of the tokens
    demux = rows["multiplexed-demux"]
    assert abs(demux["tokens"] - STREAMS * demux["messages"]) <= 8 * STREAMS

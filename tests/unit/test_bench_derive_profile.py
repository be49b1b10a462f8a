"""bench/derive_profile.py: the byte and parameter counts it scales by are the models' own, and a profile derived
for the source's own shape and GPUs gives back the source's decode steps within the fit's error."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.derive_profile import Worker, main  # noqa: E402
from deltamesh.planner.profile import Profile  # noqa: E402

SOURCE = ROOT / "bench/profiles/h200-qwen3.5-35b-a3b-from-results.json"


@pytest.mark.parametrize(
    "shape, billions, state_mib, kv_kib",  # bench/configs/README.md's table
    [("qwen3.5-35b-a3b", 34.661, 61.4, 20), ("qwen3.5-397b-a17b", 396.346, 183.2, 30)],
)
def test_counts_match_the_published_shapes(shape, billions, state_mib, kv_kib):
    w = Worker.of(str(ROOT / "bench/configs" / shape), 2.0, 1)
    assert w.params() / 1e9 == pytest.approx(billions, rel=1e-3)
    assert w.state_bytes() / 2**20 == pytest.approx(state_mib, rel=1e-3)
    assert w.kv_bytes_per_token() / 1024 == kv_kib


def test_more_gpus_read_less_each_and_a_kv_head_is_never_split():
    one, eight = (Worker.of(str(ROOT / "bench/configs/qwen3.5-397b-a17b"), 1.0, tp) for tp in (1, 8))
    assert eight.decode_bytes(1, 8192) < one.decode_bytes(1, 8192) / 7
    assert eight.kv_bytes_per_token() == one.kv_bytes_per_token() / 2  # 2 KV heads: one on each of 8 GPUs
    assert one.experts_touched(1) == pytest.approx(10) and one.experts_touched(10_000) == pytest.approx(512)


def test_the_source_derived_for_itself_gives_back_its_decode_steps(tmp_path):
    out = tmp_path / "same.json"
    main(["--source", str(SOURCE), "--target", str(ROOT / "bench/configs/qwen3.5-35b-a3b"), "--out", str(out)])
    source, derived = Profile.load(SOURCE), Profile.load(out)
    errors = derived.fit_errors["source_decode"]
    assert max(abs(e) for e in errors) < 0.15  # the two-term fit of this file's measured steps
    for (_, _, ms), (_, _, got) in zip(source.decode.points, derived.decode.points, strict=True):
        assert got == pytest.approx(ms, rel=0.15)
    assert derived.prefill.ms(8192, 8192**2 / 2) == pytest.approx(source.prefill.ms(8192, 8192**2 / 2))

"""bench/serve.py's prompts: with a server's prefix cache on, a warm-up on a measured prompt, or a point reusing an
earlier point's prompts on the same server, would turn measured requests into cache hits."""

import argparse

from bench import disagg_sweep, serve
from deltamesh.engine import DEFAULT_MODEL


def prompts(seed: int, n: int, length: int = 64) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """(the measured prompts, the warm-up's) bench/serve.py draws for these arguments."""
    args = serve.parse_args(
        ["--model-dir", str(DEFAULT_MODEL), "--num-prompts", str(n), "--input-len", str(length), "--seed", str(seed)]
    )
    vocab = serve.Vocabulary(args.model_dir)
    requests = serve.sample_requests(args, vocab)
    return [tuple(r.prompt) for r in requests], tuple(serve.warmup_request(args, vocab, requests[0]).prompt)


def test_the_warm_up_prompt_is_none_of_the_measured_ones():
    measured, warmup = prompts(seed=0, n=16)
    assert warmup not in measured and len(warmup) == len(measured[0])
    assert prompts(seed=0, n=16) == (measured, warmup)  # still seeded


def test_points_of_a_sweep_draw_prompts_of_their_own(monkeypatch):
    seeds = {}

    def fake_run(cmd, **kwargs):  # what a point would run, not run
        seeds[int(cmd[cmd.index("--max-concurrency") + 1])] = int(cmd[cmd.index("--seed") + 1])
        return argparse.Namespace(returncode=1, stdout="", stderr="not run")

    monkeypatch.setattr(disagg_sweep.subprocess, "run", fake_run)
    for c in (1, 16, 64):
        disagg_sweep.run_point("http://x", "m", 8192, 1024, c, 2 * c, disagg_sweep.Path("/nonexistent"), 1.0)
    assert len(set(seeds.values())) == 3
    first = {c: prompts(s, 4)[0] for c, s in seeds.items()}
    assert not set(first[1]) & set(first[16]) and not set(first[16]) & set(first[64])

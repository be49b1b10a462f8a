"""Async scheduling on the GPU: the same tokens as finishing every step first, and the race vLLM met on Qwen3.5
P/D — memory freed while a launched step still writes it, handed to a state arriving over another stream."""

import pytest
import torch

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.engine.step_report import StepReport

pytestmark = pytest.mark.gpu
PROMPTS = ["The Python language", "A list is", "In this tutorial, we", "The module provides"]


def test_async_scheduling_gives_the_same_tokens():
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)
    results = []
    for async_scheduling in (False, True):
        cfg = EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="float32", async_scheduling=async_scheduling)
        with Engine(cfg) as engine:
            outs = engine.generate(PROMPTS, params)
        results.append([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs])
    # the same tokens; log-probabilities to 1e-3 rather than rounded to three places and compared exactly (a
    # value near a rounding boundary can land either side of it)
    for (sync_tokens, sync_logprobs), (tokens, logprobs) in zip(*results):
        assert tokens == sync_tokens
        assert logprobs == pytest.approx(sync_logprobs, abs=1e-3)


def _freed_while_in_flight(wait: bool) -> bool:
    """A decode step is launched behind a long GPU sleep; its request is aborted and its (only) state slot is
    reserved and written from a side stream, as a UCX pull writes. True when the written bytes survive."""
    # bf16 with CUDA graphs: a decode step with no host synchronisation inside, so it is still queued on return
    core = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="bfloat16", max_num_seqs=1))
    req = core.make_request([11, 12, 13, 14], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), "a")
    core.submit(req, lambda out: None)
    core.process_commands()
    for _ in range(3):
        core.step()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the next step
    core.step()  # launches a decode step of "a" (it writes a's state slot), reads the one before
    slot = req.slot
    core.abort("a")
    core.process_commands()  # "a" ends and frees its slot while that step is still queued
    reservation = core.reservations.reserve(4)
    assert reservation.slot == slot
    recurrent = reservation.regions[-1].tensor
    if wait:
        reservation.wait_ready()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        recurrent.fill_(7)
    torch.cuda.synchronize()
    intact = bool((recurrent == 7).all())
    while core.has_work:
        core.step()
    return intact


def test_a_reservation_is_not_written_by_a_step_launched_before_it():
    assert _freed_while_in_flight(wait=True)
    # the control: without waiting, the queued step overwrites the "pulled" state (so the test above can fail)
    assert not _freed_while_in_flight(wait=False)


def test_an_eager_step_never_waits_for_the_gpu(tmp_path):
    """Prefill, mixed and sampling steps (greedy, top-k/top-p, seeded, logprobs) queue their work without a
    host synchronisation (torch's sync debug mode raises on one), so that the host prepares the next step while
    the GPU runs this one. The model has 128-wide heads: FlashInfer's GDN kernels and the Triton MoE run."""
    from hf_checkpoints import write_checkpoint

    path = write_checkpoint("qwen3_5_moe_fp8_shapes", tmp_path / "m", seed=3)
    core = EngineCore(
        EngineConfig(
            model=str(path),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=4,
            max_num_batched_tokens=256,
            cuda_graphs=False,
        )
    )
    assert core.kernels.chosen["gdn_prefill"] == "flashinfer"
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, top_k=20, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=7, min_p=0.05, logprobs=3, ignore_eos=True),
    ]
    done = []
    for i, (n, p) in enumerate(zip((200, 37, 90), params)):
        core.submit(
            core.make_request([3 + (5 * i + j) % 200 for j in range(n)], p, f"r{i}"),
            lambda out: done.append(out) if out.finished else None,
        )
    core.dispatch(core.process_commands())
    report = StepReport(core, interval_s=0.0)
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while core.has_work:  # the first steps are mixed: one prompt spans two chunks beside others' decodes
            core.dispatch(core.step())
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(done) == 3 and all(o.num_output_tokens == 6 and o.error is None for o in done) and steps >= 7
    line = report.maybe_log()  # the GPU's share of the window: inside steps, measured with CUDA events
    report.close()
    assert core.stats.gpu_step_ms > 0 and 0 < line["gpu_busy_pct"] <= 100.5


@pytest.mark.parametrize("prompts", [1, 3])
def test_states_taken_in_passing_on_the_gpu(tmp_path, prompts):
    """FlashInfer's GDN prefill and the Triton conv: the checkpoints chunks take in passing on their way to their
    prompts' ends (snapshots on; with three prompts, three in one step: the scratch slot and two free slots, the
    tails in a pass of their own) against those of chunks stopped there, within bf16 rounding (the tokens before
    them ran in steps of other sizes); the prompts take one step fewer."""
    from hf_checkpoints import write_checkpoint

    path = write_checkpoint("qwen3_5_moe_fp8_shapes", tmp_path / "m", seed=3)
    # checkpoint at 144; one prompt in chunks of 100 (a head of 44, a tail of 6), three in one step of 450
    texts = [[3 + (7 * j + 11 * i) % 200 for j in range(150)] for i in range(prompts)]
    engines = []
    for snapshots in (True, False):
        core = EngineCore(
            EngineConfig(
                model=str(path),
                device="cuda",
                dtype="bfloat16",
                max_num_seqs=8,
                max_num_batched_tokens=100 if prompts == 1 else 450,
                page_size=16,
            )
        )
        core.scheduler.snapshots = snapshots
        for i, text in enumerate(texts):
            core.submit(
                core.make_request(text, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), f"r{i}"),
                lambda out: None,
            )
        core.process_commands()
        while core.has_work:
            core.step()
        engines.append(core)
    passing, stopped = engines
    assert passing.stats.steps == stopped.stats.steps - 1
    a, b = (
        {blk.tokens: blk.checkpoint for blk in e.prefix_cache.entries.blocks.values() if blk.checkpoint is not None}
        for e in engines
    )
    assert set(a) == set(b) and len(a) == prompts
    ca, cb = passing.prefix_cache.checkpoints, stopped.prefix_cache.checkpoints
    for key in a:
        for x, y in ((ca.conv[a[key]], cb.conv[b[key]]), (ca.recurrent[a[key]], cb.recurrent[b[key]])):
            x, y = x.float(), y.float()
            assert y.abs().max() > 0.01 and (x - y).abs().max() <= 0.02 * y.abs().max()


def test_piecewise_graphs_match_the_eager_steps(tmp_path):
    """Steps with prompt tokens replayed from piecewise CUDA graphs (padded to their bucket: other GEMM shapes)
    against the same steps run eagerly: the same greedy tokens, log-probabilities within bf16 rounding, and no
    host synchronisation inside such a step (torch's sync debug mode raises on one)."""
    from hf_checkpoints import write_checkpoint

    path = write_checkpoint("qwen3_5_moe_fp8_shapes", tmp_path / "m", seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    results = []
    for limit in (0, 256):
        core = EngineCore(
            EngineConfig(
                model=str(path),
                device="cuda",
                dtype="bfloat16",
                max_num_seqs=4,
                max_num_batched_tokens=256,
                piecewise_cuda_graph_max_tokens=limit,
            )
        )
        assert (core.runner.pieces is not None) == bool(limit)
        out = {}

        def sink(o, out=out):
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            logprobs.extend(lp.logprob for lp in o.logprobs or [])

        for i, n in enumerate((200, 37, 90, 300)):  # the last spans two chunks beside the others' decodes
            core.submit(core.make_request([3 + (5 * i + j) % 200 for j in range(n)], params, f"r{i}"), sink)
        core.dispatch(core.process_commands())
        torch.cuda.set_sync_debug_mode("error")
        try:
            while core.has_work:
                core.dispatch(core.step())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append(out)
        if limit:
            assert core.runner.piecewise_steps == core.stats.mixed_steps >= 3
    eager, piecewise = results
    assert {r: t for r, (t, _) in piecewise.items()} == {r: t for r, (t, _) in eager.items()}
    for r, (_, logprobs) in eager.items():
        assert max(abs(a - b) for a, b in zip(logprobs, piecewise[r][1])) < 0.05

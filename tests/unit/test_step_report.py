"""The engine's periodic line: its counts are the steps' own (mixed steps carry prompt tokens; a CPU engine
replays no CUDA graph), a window without steps logs nothing, and the garbage collector's pauses show in the window
they stopped."""

import gc

from structlog.testing import capture_logs

from deltamesh.engine import EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.engine.step_report import StepReport


def test_a_window_reports_its_own_steps_and_tokens():
    core = EngineCore(EngineConfig(num_kv_pages=64, max_num_seqs=4, max_num_batched_tokens=8))
    report = StepReport(core, interval_s=0.0)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for i in range(2):
        core.submit(core.make_request(list(range(10 + i, 30 + i)), params, f"r{i}"), lambda out: None)
    while core.has_work or not core._commands.empty():
        core.dispatch(core.process_commands())
        core.dispatch(core.step())
    with capture_logs() as logs:
        line = report.maybe_log()
    assert logs == [{"event": "engine steps", "log_level": "info", **line}]
    # 40 prompt tokens in chunks of at most 8 per step (with the decodes beside them), then decodes alone
    assert line["steps"] == core.stats.steps and line["mixed_steps"] == core.stats.mixed_steps >= 5
    assert line["steps"] > line["mixed_steps"] and line["graph_steps"] == 0
    assert line["prompt_tok_s"] > 0 and line["generated_tok_s"] > 0 and line["running"] == 0
    assert "gpu_busy_pct" not in line and core.stats.gpu_step_ms == 0  # GPU time is measured on CUDA only
    assert report.maybe_log() is None  # nothing ran since


def test_the_collectors_pauses_show_in_the_window_they_stopped():
    core = EngineCore(EngineConfig(num_kv_pages=64, max_num_seqs=4, max_num_batched_tokens=8))
    report = StepReport(core, interval_s=0.0)
    try:
        core.submit(core.make_request(list(range(10, 20)), SamplingParams(max_tokens=2), "r0"), lambda out: None)
        while core.has_work or not core._commands.empty():
            core.dispatch(core.process_commands())
            core.dispatch(core.step())
        gc.collect()  # a full collection in the window
        line = report.maybe_log()
        assert line["gc_full"] >= 1 and line["gc_ms"] >= line["gc_longest_ms"] > 0
        core.submit(core.make_request(list(range(10, 20)), SamplingParams(max_tokens=2), "r1"), lambda out: None)
        gc.disable()  # a window without a collection says nothing of them
        try:
            while core.has_work or not core._commands.empty():
                core.dispatch(core.process_commands())
                core.dispatch(core.step())
            assert "gc_ms" not in report.maybe_log()
        finally:
            gc.enable()
    finally:
        report.close()
    assert not report.gc.counting

"""--disable-log-stats (EngineConfig.log_stats): the engine's periodic "engine steps" line is off, its steps run
as before (the Prometheus series read the engine, not the line)."""

import pytest
from structlog.testing import capture_logs

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams
from deltamesh.engine import engine as engine_module
from deltamesh.engine.step_report import StepReport


class EveryStep(StepReport):
    """A line after every step (the real interval is 10 s)."""

    def __init__(self, core):
        super().__init__(core, interval_s=0.0)


@pytest.mark.parametrize("log_stats", [True, False])
def test_the_step_report_line_follows_log_stats(monkeypatch, log_stats):
    monkeypatch.setattr(engine_module, "StepReport", EveryStep)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with capture_logs() as logs, Engine(EngineConfig(model=str(DEFAULT_MODEL), log_stats=log_stats)) as engine:
        [out] = engine.generate([[1, 2, 3]], params)
    assert len(out.token_ids) == 4
    lines = [e for e in logs if e["event"] == "engine steps"]
    assert bool(lines) == log_stats, logs

"""The whole engine on a GPU: the default model in fp32 against the CPU, token for token."""

import pytest
import torch

from deltamesh.engine import DEFAULT_MODEL, Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = ["The Python language", "A list is", "In this tutorial, we", "The module provides"]


@pytest.fixture(scope="module")
def engines():
    cpu = Engine(EngineConfig(model=str(DEFAULT_MODEL)))
    gpu = Engine(EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="float32"))
    yield cpu, gpu
    cpu.shutdown()
    gpu.shutdown()


def test_gpu_logits_match_cpu_fp32(engines):
    from deltamesh.engine.request import Request
    from deltamesh.engine.scheduler import ScheduledItem

    cpu, gpu = engines
    ids = cpu.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    logits = []
    for eng in (cpu, gpu):
        core = eng.core
        req = Request("probe", ids, SamplingParams(), None)
        req.slot, req.pages = core.state_pool.alloc(), core.kv_pool.alloc(core.kv_pool.pages_for(len(ids)))
        try:
            with torch.inference_mode():
                input_ids, batch = core.runner.prepare([ScheduledItem(req, len(ids))])
                logits.append(
                    core.model.logits(core.model(input_ids, batch, core.kv_pool, core.state_pool, core.kernels)).cpu()
                )
        finally:
            core.scheduler.free(req)
    assert (logits[0] - logits[1]).abs().max() <= 1e-3


def test_greedy_output_on_gpu_equals_cpu(engines):
    cpu, gpu = engines
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in gpu.generate(PROMPTS, params)] == [r.token_ids for r in cpu.generate(PROMPTS, params)]

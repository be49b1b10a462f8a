"""After the warm-up (engine.assembly.warm_up) a GPU worker compiles no Triton kernel inside clients' steps:
kernels/late_compiles.py counts the compiles it misses, and logs each kernel and specialization."""

import pytest
import torch

from deltamesh.engine import DEFAULT_MODEL, EngineConfig, SamplingParams
from deltamesh.engine.core import EngineCore
from deltamesh.kernels import late_compiles
from deltamesh.kernels.late_compiles import LateCompiles

pytestmark = pytest.mark.gpu


def test_the_watch_counts_a_real_compile():
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(out, value, N: tl.constexpr):  # a kernel of this test's own: compiled at its first launch
        tl.store(out + tl.arange(0, N), value)

    watch = LateCompiles()
    out = torch.empty(16, device="cuda")
    try:
        assert watch.start()
        _fill[(1,)](out, 3.0, N=16)
        _fill[(1,)](out, 4.0, N=16)  # the same specialization: no second compile
        torch.cuda.synchronize()
    finally:
        watch.stop()
    assert watch.count == 1 and watch.seconds > 0 and (out == 4).all()


def test_bursts_after_the_warm_up_compile_nothing():
    """Bursts of prompts of many lengths at once beside running decodes (chunks that take checkpoints in passing,
    tails, 2-32 sequences a step, steps of every token count class) on the engine a worker builds."""
    core = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), device="cuda", dtype="bfloat16", max_num_seqs=32))
    before = late_compiles.WATCH.count
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for burst, size in enumerate((16, 3, 32, 2)):
        for i in range(size):
            length = int(torch.randint(2, 900, (1,), generator=gen))
            prompt = torch.randint(5, 4000, (length,), generator=gen).tolist()
            core.submit(core.make_request(prompt, params, f"burst-{burst}-{i}"), lambda out: None)
        core.process_commands()
        for _ in range(4):  # the next burst arrives while this one decodes
            core.step()
    while core.has_work:
        core.step()
    assert late_compiles.WATCH.count == before, "see the log's 'kernel compiled while serving' lines"

"""kernels/late_compiles.py: Triton compiles after the warm-up are counted and logged through Triton's own compile
hooks, which stay chained to any hook installed before and are put back by stop(). (The CPU has no Triton
compiler: the hooks are called here as Triton's JIT calls them; tests/gpu/test_gpu_kernels.py compiles for real.)"""

import pytest

from deltamesh.kernels.late_compiles import LateCompiles

knobs = pytest.importorskip("triton").knobs


def test_a_compile_between_the_hooks_is_counted_and_earlier_hooks_still_run():
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["key"]))
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["key"]))
    watch = LateCompiles()
    try:
        assert watch.start() and watch.start()  # a second start changes nothing
        fn = type("JitFunctionInfo", (), {"name": "_gemv"})()
        assert not knobs.runtime.jit_cache_hook(key="k1", repr="_gemv(x: *bf16, n: i32)", fn=fn)  # compile goes on
        knobs.runtime.jit_post_compile_hook(key="k1", repr="_gemv(x: *bf16, n: i32)", fn=fn)
        assert watch.count == 1 and watch.seconds >= 0
        assert seen == [("before", "k1"), ("after", "k1")]
    finally:
        watch.stop()
    assert watch.count == 1
    knobs.runtime.jit_post_compile_hook(key="k2", fn=None)  # the earlier hook is back, the watch gone
    assert seen[-1] == ("after", "k2") and watch.count == 1
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None

"""The Triton GPU kernels (paged decode attention, GDN gates) run through Triton's CPU interpreter against
the torch reference, so CI checks their logic without a GPU. Each check runs in a subprocess because the
interpreter must be chosen before triton is imported."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str) -> str:
    # the interpreter's torch with the threads this test process has (tests/conftest.py: the cores shared among
    # xdist's workers); a limit short of pytest's own 600 s, so that a slow child is stopped with its output, not
    # a half-minute check that a machine shared with other work can make last minutes
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def check_interpreted(prelude: str, body: str) -> None:
    """Run `prelude + body` interpreted; the code fills `errors` {case: (error, tolerance)}, each must hold."""
    errors = json.loads(run_interpreted(prelude + body + "\n    print(json.dumps(errors))").splitlines()[-1])
    assert errors
    bad = {case: (e, tol) for case, (e, tol) in errors.items() if not e < tol}
    assert not bad, bad


def test_paged_decode_attention_matches_reference():
    out = run_interpreted("""
        import torch
        from deltamesh.kernels import torch_ref, triton_attention
        from deltamesh.kernels.batch import StepBatch
        torch.manual_seed(0)
        pool = torch.randn(12, 2, 2, 16, 2, 64)  # [pages, layers, k|v, page, kv heads, dim]
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # a strided layer view, as the engine passes
        seq = [5, 40, 17]
        tables = torch.tensor([[3, -1, -1], [7, 1, 9], [2, 11, -1]], dtype=torch.int32)
        q = torch.randn(3, 8, 64)
        lens = torch.tensor(seq, dtype=torch.int32)
        batch = StepBatch(3, [1, 1, 1], [s - 1 for s in seq], lens, tables,
                          torch.zeros(3, dtype=torch.long), torch.arange(3), torch.zeros(3, dtype=torch.long))
        ref = torch_ref.paged_attention(q, k_cache, v_cache, batch, 0.125)
        # tiles of one page and of several pages; one split per sequence and more splits than blocks (past the
        # default 32, as bench/gpu_kernels.py's few-sequence sweep tries)
        for launch in (triton_attention.DecodeLaunch(block_n=16, target_programs=1),
                       triton_attention.DecodeLaunch(block_n=32, target_programs=64),
                       triton_attention.DecodeLaunch(),
                       triton_attention.DecodeLaunch(block_n=16, target_programs=8192, max_splits=64)):
            got = triton_attention.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, launch)
            print(float((got - ref).abs().max()))
    """)
    errors = [float(x) for x in out.split()]
    assert len(errors) == 4 and all(e < 1e-5 for e in errors), errors  # NaN fails too


def test_fused_gdn_gates_match_reference():
    out = run_interpreted("""
        import torch
        from deltamesh.kernels import torch_ref
        from deltamesh.kernels.triton_gates import gdn_gates
        torch.manual_seed(1)
        a, b = torch.randn(37, 8) * 5, torch.randn(37, 8) * 5
        A_log, dt_bias = torch.randn(8), torch.randn(8)
        alpha, beta = gdn_gates(a, b, A_log, dt_bias)
        g, ref_beta = torch_ref.gdn_gates(a, b, A_log, dt_bias)
        print(max(float((alpha - g.exp()).abs().max()), float((beta - ref_beta).abs().max())))
    """)
    assert float(out) < 1e-5

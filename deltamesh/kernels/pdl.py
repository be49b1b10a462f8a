"""Programmatic dependent launch (PDL; Hopper and later) for the Triton kernels of this package.

A kernel launched with it may be scheduled while the kernel before it in the stream is still draining; it waits
(griddepcontrol.wait, `tl.extra.cuda.gdc_wait`) before it reads or writes any memory, which returns once the
kernel before has completed and its writes are visible. So each kernel's launch latency and start-up overlap the
tail of the one before, and the order of memory accesses is the stream's, as without PDL: a decode step at batch 1
is a long chain of short kernels with idle GPU between them (bench/RESULTS.md, "Steps back to back").

Every kernel here takes a `PDL` constexpr (default 0) and starts with `pdl_wait(PDL)` (triton_pdl.py); a launch passes
`**pdl.kwargs(device)`, which sets it and the launch attribute together, so that a kernel is never launched early
without waiting. Kernels of other libraries (cuBLAS, FlashInfer, torch) launch as before; one of ours after them may
start as their last blocks exit, before their completion is flushed, and waits as after any kernel.

Modes (`MODE`, from DELTAMESH_PDL in the environment, or set before the kernels are launched and CUDA graphs
captured): 0 off; 1 every kernel waits first; 2 as 1, and the GEMV (triton_gemv_kernels.py) loads its first weight
tile before it waits (weights are never written by a step's kernels), so that its reads from HBM start while the
kernel before drains; 3 (the default) as 2, and every kernel, once its wait returns, lets the kernel after it be
scheduled (griddepcontrol.launch_dependents), so that kernel's programs take free SMs, and the GEMV's its first
weight tiles, while this one runs. What each mode saves: bench/RESULTS.md, "Programmatic dependent launch".
"""

from __future__ import annotations

import functools
import os

import torch

_SETTING = os.environ.get("DELTAMESH_PDL", "3")
if _SETTING not in ("0", "1", "2", "3"):
    raise ValueError(f"DELTAMESH_PDL must be 0, 1, 2 or 3 (kernels/pdl.py), not {_SETTING!r}")
MODE = int(_SETTING)


@functools.cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def kwargs(device: torch.device) -> dict:
    """The launch keywords of a kernel on `device`: the PDL constexpr (the mode) and the launch attribute, or
    nothing (one dict per mode: this runs at every launch; callers only unpack it)."""
    return _keywords(MODE) if MODE and _supported(device) else _keywords(0)


@functools.cache
def _keywords(mode: int) -> dict:
    return {"PDL": mode, "launch_pdl": True} if mode else {}

"""The device side of programmatic dependent launch (pdl.py has the modes and the launch side): what every Triton
kernel of this package runs first."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Modes 1-3: wait until the kernel before has completed and its writes are visible, before any memory access
    of this one; mode 3: then let the kernel after be scheduled. Mode 0: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 3:
            tl.extra.cuda.gdc_launch_dependents()

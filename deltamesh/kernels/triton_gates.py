"""The GDN gates in one pass (Triton): alpha = exp(-exp(A_log) * softplus(a + dt_bias)) and
beta = sigmoid(b), both float32, the form FlashInfer's prefill kernel takes."""

from __future__ import annotations

import torch

from deltamesh.kernels import pdl

_KERNEL = None


def _kernel():
    import triton
    import triton.language as tl

    global pdl_wait  # a module global: Triton's interpreter resolves a kernel's callees there
    from deltamesh.kernels.triton_pdl import pdl_wait

    @triton.jit
    def gates(
        a_ptr,
        b_ptr,
        a_log_ptr,
        dt_bias_ptr,
        alpha_ptr,
        beta_ptr,
        n,
        heads: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = 0,
    ):
        pdl_wait(PDL)  # after the kernel before (pdl.py)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        h = offs % heads
        x = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
        tl.store(alpha_ptr + offs, tl.exp(g), mask=mask)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(beta_ptr + offs, 1.0 / (1.0 + tl.exp(-b)), mask=mask)

    return gates


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """a, b: [T, HV] (contiguous); returns (alpha, beta) float32 [T, HV]."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    a, b = a.contiguous(), b.contiguous()
    alpha = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(alpha)
    n, block = a.numel(), 1024
    _KERNEL[(-(-n // block),)](
        a, b, A_log, dt_bias, alpha, beta, n, heads=a.shape[-1], BLOCK=block, **pdl.kwargs(a.device)
    )
    return alpha, beta

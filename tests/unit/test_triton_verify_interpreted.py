"""Speculative verification's Triton kernels (kernels/triton_verify.py) through Triton's CPU interpreter against the
torch reference: the outputs at every token, and the GDN and conv states after every token in the draft pool, in
float32 and with a bfloat16 state pool, from strided views as the engine passes them; the pooled state untouched."""

import pytest
from test_triton_fused_interpreted import check

pytest.importorskip("triton")
pytestmark = pytest.mark.spec


def test_gdn_and_conv_verification_match_reference():
    check("""
    from deltamesh.kernels import triton_verify
    n, w, hk, hv, kd, vd = 3, 4, 2, 4, 16, 32
    for state_dtype in (torch.float32, torch.bfloat16):
        mixed = torch.randn(n * w, 2 * hk * kd + hv * vd + 7)  # a wider row: q, k, v are strided views
        q = mixed[:, : hk * kd].view(n * w, hk, kd)
        k = mixed[:, hk * kd : 2 * hk * kd].view(n * w, hk, kd)
        v = mixed[:, 2 * hk * kd : 2 * hk * kd + hv * vd].view(n * w, hv, vd)
        ba = torch.randn(n * w, 2 * hv + 3)
        b, a = ba[:, :hv], ba[:, hv : 2 * hv]
        A_log, dt_bias = torch.rand(hv).log(), torch.randn(hv)
        pool = torch.randn(6, 2, hv, vd, kd).to(state_dtype)  # [slot, layer, ...]: layer 1's rows, flattened
        flat = pool.flatten(0, 1)
        idx = torch.tensor([3, 9, 5])  # rows of layer 1 of slots 1, 4, 2
        drafts = torch.zeros(n * w + 2, hv, vd, kd, dtype=state_dtype)
        didx = torch.arange(n * w).view(n, w) + 2
        before = flat.clone()
        ref_d = drafts.clone()
        ref = torch_ref.gdn_verify(q, k, v, a, b, A_log, dt_bias, flat, idx, ref_d, didx)
        got = triton_verify.gdn_verify(q, k, v, a, b, A_log, dt_bias, flat, idx, drafts, didx)
        tag = str(state_dtype)
        errors["gdn out " + tag] = err(got, ref) if state_dtype == torch.float32 else (err(got, ref)[0], 2e-2)
        errors["gdn states " + tag] = err(drafts, ref_d) if state_dtype == torch.float32 else (err(drafts, ref_d)[0], 2e-2)
        errors["gdn pool untouched " + tag] = (float((flat.float() - before.float()).abs().max()), 1e-12)

        conv = torch.randn(7, 2, 40, 3).to(state_dtype).flatten(0, 1)
        cidx = torch.tensor([1, 4, 11])
        x = torch.randn(n * w, 40 + 5)[:, :40]
        weight = torch.randn(40, 4)
        cd, ref_cd = torch.zeros(n * w + 1, 40, 3, dtype=state_dtype), torch.zeros(n * w + 1, 40, 3, dtype=state_dtype)
        cdidx = torch.arange(n * w).view(n, w) + 1
        cbefore = conv.clone()
        ref_c = torch_ref.conv1d_verify(x, conv, cidx, ref_cd, cdidx, weight)
        got_c = triton_verify.conv1d_verify(x, conv, cidx, cd, cdidx, weight)
        errors["conv out " + tag] = (float((got_c - ref_c).abs().max()), 1e-4 if state_dtype == torch.float32 else 5e-2)
        errors["conv states " + tag] = (float((cd.float() - ref_cd.float()).abs().max()), 1e-12)
        errors["conv pool untouched " + tag] = (float((conv.float() - cbefore.float()).abs().max()), 1e-12)
    """)

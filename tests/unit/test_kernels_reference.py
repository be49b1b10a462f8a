"""The torch reference kernels against independent float64 definitions."""

import pytest
import torch
import torch.nn.functional as F

from deltamesh.kernels import torch_ref
from deltamesh.kernels.batch import StepBatch


def gdn_recurrence_f64(q, k, v, g, beta, state):
    """Token-by-token gated delta rule in float64, state in HF's [HV, K, V] orientation.
    q, k: [L, HK, K]; v: [L, HV, V]; g, beta: [L, HV]; state: [HV, K, V]."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    groups = v.shape[1] // k.shape[1]
    q = F.normalize(q, dim=-1, eps=0).repeat_interleave(groups, 1) * q.shape[-1] ** -0.5
    k = F.normalize(k, dim=-1, eps=0).repeat_interleave(groups, 1)
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        err = v[t] - torch.einsum("hkv,hk->hv", s, k[t])
        s = s + torch.einsum("hk,hv->hkv", k[t], err * beta[t][:, None])
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def random_gdn(lens, hk=2, hv=4, dk=16, dv=24, seed=0):
    """Raw GDN inputs (gates before activation), the float64 gates they mean, and a state pool."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(t, hk, dk), r(t, hk, dk), r(t, hv, dv)
    a, b = r(t, hv), r(t, hv) * 2
    A_log, dt_bias = torch.empty(hv).uniform_(-2, 0.5, generator=gen), r(hv) * 0.5
    gates = (a, b, A_log, dt_bias)
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())  # log-decay <= 0
    beta = torch.sigmoid(b.double())
    pool = r(len(lens) + 3, hv, dv, dk) * 0.5  # [P, HV, V, K], K-last
    return q, k, v, gates, (g, beta), pool


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_chunked_gdn_matches_float64_recurrence_with_initial_state():
    lens = [1, 63, 64, 65, 200]
    q, k, v, gates, (g, beta), pool = random_gdn(lens)
    idx = torch.tensor([4, 0, 2, 5, 1])
    initial = pool.clone()
    out = torch_ref.gdn_prefill(q, k, v, *gates, lens, None, pool, idx)
    start = 0
    for i, n in enumerate(lens):
        sl = slice(start, start + n)
        ref_out, ref_state = gdn_recurrence_f64(q[sl], k[sl], v[sl], g[sl], beta[sl], initial[idx[i]].transpose(-1, -2))
        assert rel_err(out[sl], ref_out) < 1e-5
        assert rel_err(pool[idx[i]], ref_state.transpose(-1, -2)) < 1e-5
        start += n
    untouched = [j for j in range(pool.shape[0]) if j not in idx.tolist()]
    assert torch.equal(pool[untouched], initial[untouched])


def test_decode_step_matches_float64_recurrence():
    q, k, v, gates, (g, beta), pool = random_gdn([1, 1, 1], seed=1)
    idx = torch.tensor([2, 0, 1])
    initial = pool.clone()
    out = torch_ref.gdn_decode(q, k, v, *gates, pool, idx)
    for i in range(3):
        ref_out, ref_state = gdn_recurrence_f64(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], initial[idx[i]].transpose(-1, -2)
        )
        assert rel_err(out[i], ref_out[0]) < 1e-6
        assert rel_err(pool[idx[i]], ref_state.transpose(-1, -2)) < 1e-6


@pytest.mark.parametrize("lens", [[1, 5, 9], [3]])
def test_conv1d_prefill_and_update_match_dense_conv(lens):
    gen = torch.Generator().manual_seed(2)
    c, w = 12, 4
    weight = torch.randn(c, w, generator=gen)
    history = torch.randn(len(lens), c, w - 1, generator=gen)
    x = torch.randn(sum(lens), c, generator=gen)
    pool = torch.zeros(len(lens) + 1, c, w - 1)
    idx = torch.arange(1, len(lens) + 1)
    pool[idx] = history
    y = torch_ref.conv1d_prefill(x, lens, None, pool, idx, weight, "silu")
    start = 0
    for i, n in enumerate(lens):
        full = torch.cat([history[i], x[start : start + n].T], dim=-1).double()  # [C, W-1+n]
        ref = F.silu(F.conv1d(full[None], weight.double()[:, None], groups=c))[0].T
        assert torch.allclose(y[start : start + n].double(), ref, atol=1e-5)
        assert torch.equal(pool[idx[i]], full[:, -(w - 1) :].float())
        start += n
    step = torch.randn(len(lens), c, generator=gen)
    before = pool[idx].clone()
    y1 = torch_ref.conv1d_update(step, pool, idx, weight, "silu")
    window = torch.cat([before, step[..., None]], -1).double()
    assert torch.allclose(y1.double(), F.silu((window * weight.double()).sum(-1)), atol=1e-5)


def test_paged_attention_matches_dense_causal_attention():
    gen = torch.Generator().manual_seed(3)
    page_size, hq, hkv, d = 4, 4, 2, 8
    ctx, qlen = [0, 6, 11], [5, 1, 3]  # one fresh prefill, one decode, one continued chunk
    order = [1, 0, 2]  # decode-first, as the engine lays out a step
    ctx, qlen = [ctx[i] for i in order], [qlen[i] for i in order]
    pages = [[7, 3], [0, 5], [2, 9, 4, 8]]
    pages = [pages[i] for i in order]
    kv = torch.zeros(10, page_size, hkv, d), torch.zeros(10, page_size, hkv, d)
    keys = [torch.randn(c + n, hkv, d, generator=gen) for c, n in zip(ctx, qlen)]
    vals = [torch.randn(c + n, hkv, d, generator=gen) for c, n in zip(ctx, qlen)]
    slot = lambda s, p: pages[s][p // page_size] * page_size + p % page_size  # noqa: E731
    for s, (c, _n) in enumerate(zip(ctx, qlen)):  # context already cached
        torch_ref.write_kv(
            *kv, keys[s][:c], vals[s][:c], torch.tensor([slot(s, p) for p in range(c)], dtype=torch.long)
        )
    new_k = torch.cat([keys[s][c:] for s, c in enumerate(ctx)])
    new_v = torch.cat([vals[s][c:] for s, c in enumerate(ctx)])
    mapping = torch.tensor([slot(s, p) for s, (c, n) in enumerate(zip(ctx, qlen)) for p in range(c, c + n)])
    torch_ref.write_kv(*kv, new_k, new_v, mapping)
    q = torch.randn(sum(qlen), hq, d, generator=gen)
    tables = torch.full((3, 4), -1, dtype=torch.int32)
    for s, p in enumerate(pages):
        tables[s, : len(p)] = torch.tensor(p)
    batch = StepBatch(
        1,
        qlen,
        ctx,
        torch.tensor([c + n for c, n in zip(ctx, qlen)]),
        tables,
        mapping,
        torch.tensor([0, 1, 2]),
        torch.zeros(9, dtype=torch.long),
    )
    out = torch_ref.paged_attention(q, *kv, batch, d**-0.5)
    start = 0
    for s, (c, n) in enumerate(zip(ctx, qlen)):
        qs = q[start : start + n].double().transpose(0, 1)  # [Hq, n, d]
        k = keys[s].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        v = vals[s].double().repeat_interleave(hq // hkv, 1).transpose(0, 1)
        scores = qs @ k.transpose(-1, -2) * d**-0.5
        allowed = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
        ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(0, 1)
        assert torch.allclose(out[start : start + n].double(), ref, atol=1e-5)
        start += n

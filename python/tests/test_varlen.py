"""mala.attention_varlen equals running each sequence alone (outputs, lse, gradients, work)."""

import pytest
import torch

import mala
from conftest import device_params, local_inputs, rand, reference_attention, rel_l2


def _pack(seqs):
    lengths = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return torch.cat(seqs, 0), cu, int(lengths.max())


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tau", [0.0, 1.0])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_equals_each_sequence_alone(device, tau, causal):
    torch.manual_seed(0)
    # Unequal lengths, one key length differing from its query length, an odd length.
    lengths_q = [300, 1, 129, 77]
    lengths_k = [300, 1, 129, 200]
    hq, hkv, d = 4, 2, 64
    qs, ks, vs = [], [], []
    for i, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        q, k, v = local_inputs(device, 1, max(nq, nk), hq, hkv, d, sharpness=2.0, seed=i)
        qs.append(q[0, -nq:])
        ks.append(k[0, :nk])
        vs.append(v[0, :nk])
    q, cu_q, max_q = _pack(qs)
    k, cu_k, max_k = _pack(ks)
    v, _, _ = _pack(vs)
    cu_q, cu_k = cu_q.to(device), cu_k.to(device)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    out, lse, stats = mala.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau=tau, causal=causal,
                                            return_lse=True, return_stats=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])

    for b in range(len(lengths_q)):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qb, kb, vb = (t[s].detach().unsqueeze(0).requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        ob, lseb, sb = mala.attention(qb, kb, vb, tau=tau, causal=causal, return_lse=True, return_stats=True)
        gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), dout[sq].unsqueeze(0))
        # Same rule, same tiles, same data: the same result up to accumulation order.
        tol = dict(atol=2e-2, rtol=2e-2) if q.dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[sq], ob[0], **tol)
        torch.testing.assert_close(lse[:, sq], lseb[0], atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(dq[sq], gq[0], **tol)
        torch.testing.assert_close(dk[sk], gk[0], **tol)
        torch.testing.assert_close(dv[sk], gv[0], **tol)
        assert torch.equal(stats.fwd_slots[:, sq], sb.fwd_slots[0]), f"sequence {b}: forward work differs"
        assert torch.equal(stats.bwd_slots[:, sq], sb.bwd_slots[0]), f"sequence {b}: backward work differs"
        if tau == 0.0:
            ref, _ = reference_attention(qb, kb, vb, causal)
            assert rel_l2(ob, ref) < 1e-2


@pytest.mark.parametrize("device", device_params())
def test_varlen_empty_sequence(device):
    """A sequence of length 0 in the middle of the batch is allowed and changes nothing."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = rand((100, 2, 64), device, dtype)
    k = rand((100, 2, 64), device, dtype)
    v = rand((100, 2, 64), device, dtype)
    cu = torch.tensor([0, 60, 60, 100], dtype=torch.int32, device=device)
    out = mala.attention_varlen(q, k, v, cu, cu, 60, 60, tau=0.0)
    first = mala.attention(q[None, :60], k[None, :60], v[None, :60], tau=0.0)[0]
    last = mala.attention(q[None, 60:], k[None, 60:], v[None, 60:], tau=0.0)[0]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, torch.cat([first, last]), **tol)

"""mala.scaled_dot_product_attention: torch's SDPA signature and [B, H, N, d] layout over mala.attention."""

import pytest
import torch
import torch.nn.functional as F

import mala
from conftest import device_params, dtype_for, local_inputs, rand, rel_l2


def _bhnd(device, b, n, hq, hkv, d, seed=0):
    """Inputs in SDPA's layout, made as [B, N, H, d] and transposed (so the views are what a model passes)."""
    q, k, v = local_inputs(device, b, n, hq, hkv, d, seed=seed)
    return (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("is_causal", [True, False])
def test_equals_torch_sdpa_at_tau0(device, is_causal):
    q, k, v = _bhnd(device, 2, 160, 4, 4, 64)
    out = mala.scaled_dot_product_attention(q, k, v, is_causal=is_causal, tau=0.0)
    assert out.shape == q.shape and out.dtype == q.dtype
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=is_causal)
    tol = 1e-2 if q.dtype != torch.float32 else 1e-5
    assert rel_l2(out, ref) < tol
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert g.shape == r.shape and rel_l2(g, r) < 2 * tol + 1e-5, f"d{name}"


@pytest.mark.parametrize("device", device_params())
def test_gqa_scale_and_tau(device):
    q, k, v = _bhnd(device, 1, 200, 8, 2, 64, seed=1)
    out = mala.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True, tau=0.0)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.1, enable_gqa=True)
    assert rel_l2(out, ref) < (1e-2 if q.dtype != torch.float32 else 1e-5)
    # The default tau is 1.0: mala.attention on the transposed views, bit for bit.
    got = mala.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = mala.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    assert torch.equal(got, want)
    # Non-causal with seqlen_q != seqlen_k needs no alignment convention.
    k2, v2 = (rand((1, 2, 90, 64), device, q.dtype) for _ in range(2))
    out2 = mala.scaled_dot_product_attention(q, k2, v2, enable_gqa=True, tau=0.0)
    ref2 = F.scaled_dot_product_attention(q.float(), k2.float(), v2.float(), enable_gqa=True)
    assert rel_l2(out2, ref2) < (1e-2 if q.dtype != torch.float32 else 1e-5)


def test_what_mala_does_not_do_is_named():
    q, k, v = (rand((1, 4, 16, 64), "cpu", torch.float32) for _ in range(3))
    cases = [
        (NotImplementedError, "attn_mask", dict(attn_mask=torch.ones(16, 16, dtype=torch.bool))),
        (NotImplementedError, "dropout_p", dict(dropout_p=0.1)),
    ]
    for exc, name, kwargs in cases:
        with pytest.raises(exc, match=name):
            mala.scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="is_causal"):
        mala.scaled_dot_product_attention(q, k[:, :, :8], v[:, :, :8], is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        mala.scaled_dot_product_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="query"):
        mala.scaled_dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="^scale"):
        mala.scaled_dot_product_attention(q, k, v, scale=0.0)

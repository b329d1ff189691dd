"""Head dims without a CUDA kernel (below 256, other than 64 and 128): attention and attention_varlen
run them at the next kernel head dim, zero-padded; out is a view of the caller's columns."""

import math

import pytest
import torch

import mala
from conftest import HAS_CUDA, dtype_for, local_inputs, rand, reference_attention, rel_l2
from mala.api import _call_padded, _pad_target
from mala.flash_attn_interface import flash_attn_func


def test_pad_target():
    assert [_pad_target(d) for d in (64, 128, 256)] == [None, None, None]
    assert [_pad_target(d) for d in (8, 32, 63, 65, 80, 96, 112, 129, 160, 192, 255)] == \
        [64, 64, 64, 128, 128, 128, 128, 256, 256, 256, 256]
    assert _pad_target(257) is None and _pad_target(512) is None and _pad_target(0) is None


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_padded_call_equals_the_native_head_dim(tau):
    """On the CPU, which runs any head dim: the padded call equals the call at the caller's head dim
    (outputs, lse, gradients; the scale stays 1/sqrt(96)), and out is a view of its columns."""
    q, k, v = (t.detach().requires_grad_() for t in local_inputs("cpu", 1, 160, 4, 2, 96, sharpness=3.0))
    kw = dict(tau=tau, causal=True, return_lse=True)
    out, lse = _call_padded(mala.attention, 128, q, k, v, None, kw)
    ref, ref_lse = mala.attention(q, k, v, **kw)
    assert out.shape == q.shape and out.stride(-2) == 128 and out.stride(-1) == 1
    assert rel_l2(out, ref) < 1e-5 and rel_l2(lse, ref_lse) < 1e-6
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert g.shape == r.shape and rel_l2(g, r) < 1e-5, f"d{name}"
    # A caller's scale is kept.
    out_s = _call_padded(mala.attention, 128, q, k, v, 0.05, dict(tau=tau, causal=True))
    assert rel_l2(out_s, mala.attention(q, k, v, tau=tau, causal=True, softmax_scale=0.05)) < 1e-5


cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")


@cuda
@pytest.mark.parametrize("d", [32, 80, 96, 160])
def test_cuda_head_dims_without_a_kernel(d):
    dtype = dtype_for("cuda")
    q, k, v = (t.detach().requires_grad_() for t in local_inputs("cuda", 2, 300, 8, 2, d, dtype=dtype))
    out, lse = mala.attention(q, k, v, tau=0.0, causal=True, return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_l2(out, ref) < 2e-2
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-2
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    for g, r, name in zip(grads, ref_grads, "qkv"):
        assert g.shape == r.shape and rel_l2(g, r) < 3e-2, f"d{name}"
    # tau = 1 and the flash_attn shim take the same path.
    out1 = mala.attention(q, k, v, tau=1.0, causal=True)
    assert torch.equal(flash_attn_func(q, k, v, causal=True), out1)
    assert rel_l2(out1, ref) < 5e-2


@cuda
def test_cuda_tile_sizes_are_the_padded_kernels():
    dtype = dtype_for("cuda")
    q96, k96 = rand((1, 512, 8, 96), "cuda", dtype), rand((1, 512, 2, 96), "cuda", dtype)
    q128, k128 = rand((1, 512, 8, 128), "cuda", dtype), rand((1, 512, 2, 128), "cuda", dtype)
    for kernel in ("forward", "backward"):
        assert mala.tile_sizes(kernel, q96, k96) == mala.tile_sizes(kernel, q128, k128)


@cuda
def test_cuda_varlen_head_dim_without_a_kernel():
    dtype = dtype_for("cuda")
    cu = torch.tensor([0, 70, 71, 201], dtype=torch.int32, device="cuda")
    q, k, v = (rand((201, h, 96), "cuda", dtype) for h in (4, 2, 2))
    out = mala.attention_varlen(q, k, v, cu, cu, 130, 130, tau=0.0, causal=True)
    assert out.shape == q.shape
    for b in range(3):
        s, e = cu[b].item(), cu[b + 1].item()
        if e == s:
            continue
        one = mala.attention(q[None, s:e], k[None, s:e], v[None, s:e], tau=0.0, causal=True)[0]
        assert rel_l2(out[s:e], one) < 1e-2


@cuda
def test_cuda_head_dims_the_library_rejects():
    dtype = dtype_for("cuda")
    q, k, v = (rand((1, 64, h, 320), "cuda", dtype) for h in (4, 2, 2))
    with pytest.raises(RuntimeError, match="head_dim"):
        mala.attention(q, k, v)
    # Decode appends into the caller's cache in place, so it is not padded: the library names head_dim.
    kc, vc = rand((1, 32, 2, 96), "cuda", dtype), rand((1, 32, 2, 96), "cuda", dtype)
    with pytest.raises(RuntimeError, match="head_dim"):
        mala.attention_with_kvcache(rand((1, 1, 4, 96), "cuda", dtype), kc, vc, 16)

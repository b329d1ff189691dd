"""torch.compile(fullgraph=True) through the custom operators (fake implementations + autograd)."""

import pytest
import torch

import mala
from conftest import device_params, dtype_for, rand


def _backend(device):
    # CPU: trace with the fake implementations and AOT autograd but skip inductor's slow C++ build.
    return "inductor" if device == "cuda" else "aot_eager"


def _loss(q, k, v):
    out = mala.attention(q, k, v, tau=1.0)
    return out.float().square().sum()


@pytest.mark.parametrize("device", device_params())
def test_compile_fullgraph_forward_backward(device):
    torch._dynamo.reset()
    dtype = dtype_for(device)
    shape_q, shape_kv = (2, 192, 4, 64), (2, 192, 2, 64)
    q, k, v = (rand(s, device, dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv))

    eager_loss = _loss(q, k, v)
    eager_grads = torch.autograd.grad(eager_loss, (q, k, v))

    compiled = torch.compile(_loss, fullgraph=True, backend=_backend(device))
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-3, atol=1e-3)
    for g, eg in zip(grads, eager_grads):
        torch.testing.assert_close(g, eg, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", device_params())
def test_compile_fullgraph_varlen_and_kvcache(device):
    torch._dynamo.reset()
    dtype = dtype_for(device)
    q = rand((150, 4, 64), device, dtype).requires_grad_()
    k = rand((150, 2, 64), device, dtype).requires_grad_()
    v = rand((150, 2, 64), device, dtype).requires_grad_()
    cu = torch.tensor([0, 100, 150], dtype=torch.int32, device=device)

    def varlen_loss(q, k, v, cu):
        return mala.attention_varlen(q, k, v, cu, cu, 100, 100, tau=1.0).float().sum()

    loss = torch.compile(varlen_loss, fullgraph=True, backend=_backend(device))(q, k, v, cu)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = varlen_loss(q, k, v, cu)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-2)
    for g, eg in zip(grads, eager_grads):
        torch.testing.assert_close(g, eg, rtol=1e-2, atol=1e-2)

    # Decode with an in-place cache append inside a compiled function.
    k_cache = torch.zeros((2, 256, 2, 64), device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    lens = torch.tensor([10, 200], dtype=torch.int32, device=device)
    qd = rand((2, 1, 4, 64), device, dtype)
    kn, vn = rand((2, 1, 2, 64), device, dtype), rand((2, 1, 2, 64), device, dtype)

    def decode(qd, k_cache, v_cache, lens, kn, vn):
        return mala.attention_with_kvcache(qd, k_cache, v_cache, lens, k=kn, v=vn, tau=1.0)

    out = torch.compile(decode, fullgraph=True, backend=_backend(device))(qd, k_cache, v_cache, lens, kn, vn)
    assert torch.equal(k_cache[1, 200], kn[1, 0]), "the compiled call must append into the cache"
    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    torch.testing.assert_close(out, decode(qd, k2, v2, lens, kn, vn), rtol=0, atol=0)

    def per_split(qd, k_cache, v_cache, lens):  # split_rule reaches the operator through the compiled graph
        return mala.attention_with_kvcache(qd, k_cache, v_cache, lens, tau=1.0, num_splits=2, split_rule="per_split")

    out = torch.compile(per_split, fullgraph=True, backend=_backend(device))(qd, k_cache, v_cache, lens)
    torch.testing.assert_close(out, per_split(qd, k_cache, v_cache, lens), rtol=0, atol=0)


def test_fake_tensor_shapes():
    """The fake implementations give the real operators' shapes and dtypes (no device needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty((2, 33, 8, 128), dtype=torch.bfloat16)
        k = torch.empty((2, 70, 2, 128), dtype=torch.bfloat16)
        out, lse, slots, mask = torch.ops.mala.fwd(q, k, k, 1.0, True, 0.0, False)
        assert out.shape == q.shape and lse.shape == (2, 8, 33) and lse.dtype == torch.float32
        assert slots.numel() == 0 and mask.numel() == 0
        dq, dk, dv, _, _ = torch.ops.mala.bwd(out, q, k, k, out, lse, 1.0, True, 0.0, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        out, lse, slots = torch.ops.mala.kvcache(q[:, :1], k, k, torch.empty(2, dtype=torch.int32), None, None, None,
                                                 1.0, True, 0.0, 0, True)
        assert out.shape == (2, 1, 8, 128) and slots.shape == (2, 8, 1)
        out, lse, slots = torch.ops.mala.kvcache(q[:, :1], k, k, torch.empty(2, dtype=torch.int32), None, None, None,
                                                 1.0, True, 0.0, 2, False, "seeded")
        assert out.shape == (2, 1, 8, 128) and slots.numel() == 0

"""mala.flash_attn_interface: flash_attn's signatures and defaults over the MALA operators."""

import pytest
import torch

import mala
from conftest import device_params, dtype_for, local_inputs, rand, reference_attention, rel_l2
from mala.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                      flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                      flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("causal", [False, True])
def test_func_is_attention_with_flash_attn_defaults(device, causal):
    q, k, v = local_inputs(device, 2, 200, 4, 2, 64)
    # Positional arguments in flash_attn's order: dropout_p, softmax_scale, causal.
    out = flash_attn_func(q, k, v, 0.0, None, causal, tau=0.0)
    ref, _ = reference_attention(q, k, v, causal)
    assert rel_l2(out, ref) < 1e-2
    assert torch.equal(out, mala.attention(q, k, v, tau=0.0, causal=causal))
    # Default tau is MALA's 1.0; default causal is flash_attn's False.
    assert torch.equal(flash_attn_func(q, k, v), mala.attention(q, k, v, tau=1.0, causal=False))
    out2, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, tau=0.0)
    assert probs is None and torch.equal(out2, out) and lse.shape == (2, 4, 200) and lse.dtype == torch.float32


@pytest.mark.parametrize("device", device_params())
def test_func_gradients(device):
    q, k, v = (t.detach().requires_grad_() for t in local_inputs(device, 1, 160, 4, 1, 64))
    flash_attn_func(q, k, v, causal=True, tau=0.0).float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention(q2, k2, v2, True)
    ref.square().sum().backward()
    for g, r, name in zip(grads, (q2.grad, k2.grad, v2.grad), "qkv"):
        assert rel_l2(g, r) < 2e-2, f"d{name}"


@pytest.mark.parametrize("device", device_params())
def test_varlen_is_attention_varlen(device):
    dtype = dtype_for(device)
    lengths = [70, 1, 130]
    cu = torch.tensor([0, 70, 71, 201], dtype=torch.int32, device=device)
    q, k, v = (rand((201, h, 64), device, dtype) for h in (4, 2, 2))
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, tau=0.0)
    assert torch.equal(out, mala.attention_varlen(q, k, v, cu, cu, 130, 130, tau=0.0, causal=True))
    out2, lse, probs = flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, causal=True, return_attn_probs=True, tau=0.0)
    assert probs is None and torch.equal(out2, out) and lse.shape == (4, 201)


@pytest.mark.parametrize("device", device_params())
def test_kvcache_is_attention_with_kvcache(device):
    dtype = dtype_for(device)
    batch, capacity, hq, hkv, d = 2, 300, 8, 2, 128
    k_cache, v_cache = rand((batch, capacity, hkv, d), device, dtype), rand((batch, capacity, hkv, d), device, dtype)
    q = rand((batch, 1, hq, d), device, dtype)
    k_new, v_new = rand((batch, 1, hkv, d), device, dtype), rand((batch, 1, hkv, d), device, dtype)
    lens = torch.tensor([17, 250], dtype=torch.int32, device=device)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True,
                                       return_softmax_lse=True, tau=0.0)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref_out, ref_lse = mala.attention_with_kvcache(q, kc2, vc2, lens, k=k_new, v=v_new, tau=0.0, causal=True,
                                                   return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # appended in place, the same way
    # cache_seqlens None: the caches are full.
    full = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, tau=0.0)
    assert torch.equal(full, mala.attention_with_kvcache(q, k_cache, v_cache, capacity, tau=0.0, causal=True))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new)


@pytest.mark.parametrize("kwargs, name", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(window_size=(64, 0)), "window_size"),
    (dict(softcap=30.0), "softcap"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
])
def test_unsupported_arguments_raise(kwargs, name):
    q, k, v = (rand((1, 8, h, 64), "cpu", torch.float32) for h in (4, 4, 4))
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_func(q, k, v, **kwargs)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, **kwargs)


@pytest.mark.parametrize("device", device_params())
def test_deterministic_gradients_repeat(device):
    """deterministic=True: bit-identical gradients over three backward passes (CPU: always; CUDA: the
    Hopper backward, an error naming the argument elsewhere)."""
    dtype = dtype_for(device)
    q, k, v = (rand((1, 200, h, 64), device, dtype).requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor([0, 70, 200], dtype=torch.int32, device=device)
    for call in (lambda: flash_attn_func(q, k, v, causal=True, deterministic=True),
                 lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 130, 130, causal=True, deterministic=True)):
        grads = []
        for _ in range(3):
            try:
                out = call()
            except RuntimeError as e:  # a GPU without the Hopper backward
                assert "deterministic" in str(e)
                pytest.skip("deterministic backward not available on this device")
            try:
                g = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            except RuntimeError as e:
                assert "deterministic" in str(e)
                pytest.skip("deterministic backward not available on this device")
            grads.append(g)
        for g in grads[1:]:
            for a, b in zip(grads[0], g):
                assert torch.equal(a, b)


def test_kvcache_unsupported_arguments_raise():
    q = rand((1, 1, 4, 64), "cpu", torch.float32)
    kc = rand((1, 16, 4, 64), "cpu", torch.float32)
    for kwargs, name in [(dict(rotary_cos=torch.ones(16, 32), rotary_sin=torch.ones(16, 32)), "rotary"),
                         (dict(cache_batch_idx=torch.zeros(1, dtype=torch.int32)), "cache_batch_idx"),
                         (dict(cache_leftpad=torch.zeros(1, dtype=torch.int32)), "cache_leftpad"),
                         (dict(window_size=(8, 0)), "window_size"), (dict(softcap=5.0), "softcap")]:
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=4, **kwargs)


@pytest.mark.parametrize("device", device_params(cpu=False))
def test_kvcache_checks_only_on_request(device):
    """Like flash_attn, no host-side validation (no synchronization) unless check_inputs=True.  (The CPU
    implementation validates lengths itself: host memory, no synchronization to avoid.)"""
    dtype = dtype_for(device)
    q = rand((1, 1, 4, 64), device, dtype)
    kc, vc = rand((1, 16, 2, 64), device, dtype), rand((1, 16, 2, 64), device, dtype)
    bad = torch.tensor([40], dtype=torch.int32, device=device)  # beyond the capacity of 16
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad, causal=True)  # clamped, not checked
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad, causal=True, check_inputs=True)


@pytest.mark.parametrize("device", device_params())
def test_packed_forms_are_the_unpacked_calls(device):
    """The packed forms read views of the packed tensor: the same outputs as the unpacked functions on
    those views, bit for bit, and one gradient of the packed shape equal to the unpacked gradients."""
    dtype = dtype_for(device)
    qkv = rand((2, 150, 3, 4, 64), device, dtype).requires_grad_()
    q, k, v = qkv.unbind(2)
    out = flash_attn_qkvpacked_func(qkv, 0.0, None, True, tau=0.0)
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True, tau=0.0))
    out1, lse, probs = flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)  # tau = 1
    assert probs is None and lse.shape == (2, 4, 150)
    assert torch.equal(out1, flash_attn_func(q, k, v, causal=True))
    # The gradient: one tensor shaped like qkv, holding dq, dk, dv of separate leaves.
    (dqkv,) = torch.autograd.grad(out.float().square().sum(), qkv)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(flash_attn_func(*leaves, causal=True, tau=0.0).float().square().sum(), leaves)
    assert dqkv.shape == qkv.shape
    for i, g in enumerate(ref_grads):
        assert rel_l2(dqkv[:, :, i], g) < 1e-3, "dqkv[:, :, %d]" % i

    # kv packed, GQA (8 query heads on 2 KV heads).
    qg = rand((2, 150, 8, 64), device, dtype)
    kv = rand((2, 190, 2, 2, 64), device, dtype)
    assert torch.equal(flash_attn_kvpacked_func(qg, kv, causal=True, tau=0.0),
                       flash_attn_func(qg, kv[:, :, 0], kv[:, :, 1], causal=True, tau=0.0))


@pytest.mark.parametrize("device", device_params())
def test_varlen_packed_forms_are_the_unpacked_calls(device):
    dtype = dtype_for(device)
    cu = torch.tensor([0, 70, 71, 201], dtype=torch.int32, device=device)
    qkv = rand((201, 3, 4, 64), device, dtype)
    out, lse, probs = flash_attn_varlen_qkvpacked_func(qkv, cu, 130, causal=True, return_attn_probs=True, tau=0.0)
    assert probs is None and lse.shape == (4, 201)
    assert torch.equal(out, flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 130, 130, causal=True,
                                                   tau=0.0))
    q = rand((201, 8, 64), device, dtype)
    cu_k = torch.tensor([0, 90, 100, 300], dtype=torch.int32, device=device)
    kv = rand((300, 2, 2, 64), device, dtype)
    assert torch.equal(flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 130, 200, causal=True),
                       flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu_k, 130, 200, causal=True))


def test_packed_forms_check_the_packing_and_the_flags():
    q = rand((1, 8, 4, 64), "cpu", torch.float32)
    for call, name in [(lambda: flash_attn_qkvpacked_func(rand((1, 8, 2, 4, 64), "cpu", torch.float32)), "qkv"),
                       (lambda: flash_attn_qkvpacked_func(q), "qkv"),
                       (lambda: flash_attn_kvpacked_func(q, rand((1, 8, 3, 4, 64), "cpu", torch.float32)), "kv"),
                       (lambda: flash_attn_varlen_qkvpacked_func(q[0], torch.tensor([0, 8], dtype=torch.int32), 8),
                        "qkv"),
                       (lambda: flash_attn_varlen_kvpacked_func(q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                                                torch.tensor([0, 8], dtype=torch.int32), 8, 8), "kv")]:
        with pytest.raises(ValueError, match=name + ": must have shape"):
            call()
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_qkvpacked_func(rand((1, 8, 3, 4, 64), "cpu", torch.float32), dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn_varlen_kvpacked_func(q[0], rand((8, 2, 4, 64), "cpu", torch.float32),
                                        torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32),
                                        8, 8, window_size=(4, 0))

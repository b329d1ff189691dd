"""Bad arguments raise Python exceptions whose message starts with the argument's name."""

import pytest
import torch

import mala
from conftest import HAS_CUDA, device_params, dtype_for, rand


def _qkv(device, b=1, n=64, hq=4, hkv=2, d=64, dtype=None):
    dtype = dtype or dtype_for(device)
    return rand((b, n, hq, d), device, dtype), rand((b, n, hkv, d), device, dtype), rand((b, n, hkv, d), device, dtype)


def _raises(exc, name, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value).lstrip()
    # Our own checks start with the name; the library's come as "mala.<op>: <name>: ...".
    assert message.startswith(name + ":") or f": {name}:" in message, message


@pytest.mark.parametrize("device", device_params())
def test_attention_argument_errors(device):
    q, k, v = _qkv(device)
    _raises(ValueError, "tau", mala.attention, q, k, v, tau=-1.0)
    _raises(ValueError, "tau", mala.attention, q, k, v, tau=float("nan"))
    _raises(ValueError, "softmax_scale", mala.attention, q, k, v, softmax_scale=0.0)
    _raises(TypeError, "q", mala.attention, q.to(torch.int32), k, v)
    _raises(TypeError, "k", mala.attention, q, k.to(torch.float16 if q.dtype != torch.float16 else torch.bfloat16), v)
    _raises(ValueError, "k", mala.attention, q, rand((1, 64, 3, 64), device, q.dtype), rand((1, 64, 3, 64), device, q.dtype))
    _raises(ValueError, "k", mala.attention, q, rand((1, 64, 2, 32), device, q.dtype), rand((1, 64, 2, 32), device, q.dtype))
    _raises(ValueError, "v", mala.attention, q, k, v[:, :32])
    _raises(ValueError, "k", mala.attention, q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    _raises(ValueError, "q", mala.attention, q[0], k, v)
    # Last dimension not contiguous.
    q_strided = rand((1, 64, 4, 128), device, q.dtype)[..., ::2]
    _raises(ValueError, "q", mala.attention, q_strided, k, v)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_cuda_specific_errors():
    q, k, v = _qkv("cuda")
    _raises(TypeError, "q", mala.attention, q.float(), k.float(), v.float())
    _raises(ValueError, "k", mala.attention, q, k.cpu(), v)
    # head_dim over the kernels' 256 (smaller ones are padded: test_head_dims.py): the library names it.
    q320, k320, v320 = _qkv("cuda", d=320)
    _raises(RuntimeError, "head_dim", mala.attention, q320, k320, v320)


@pytest.mark.parametrize("device", device_params())
def test_varlen_errors(device):
    dtype = dtype_for(device)
    q, k, v = (rand((100, h, 64), device, dtype) for h in (4, 2, 2))
    good = torch.tensor([0, 40, 100], dtype=torch.int32, device=device)
    f = mala.attention_varlen
    _raises(ValueError, "cu_seqlens_q", f, q, k, v, torch.tensor([1, 40, 100], dtype=torch.int32, device=device),
            good, 60, 60)
    _raises(ValueError, "cu_seqlens_k", f, q, k, v, good,
            torch.tensor([0, 70, 60], dtype=torch.int32, device=device), 60, 70)
    _raises(ValueError, "cu_seqlens_q", f, q, k, v, torch.tensor([0, 40, 90], dtype=torch.int32, device=device),
            good, 60, 60)
    _raises(ValueError, "cu_seqlens_q", f, q, k, v, good, good, 50, 60)
    _raises(ValueError, "cu_seqlens_q", f, q, k, v, good.long(), good, 60, 60)
    _raises(ValueError, "cu_seqlens_k", f, q, k, v, good, torch.tensor([0, 100], dtype=torch.int32, device=device),
            60, 100)
    # The operator's own checks (what runs when host checks are off).
    _raises(TypeError, "cu_seqlens_q", f, q, k, v, good.long(), good, 60, 60, check_inputs=False)
    _raises(ValueError, "max_seqlen_q", f, q, k, v, good, good, 0, 60, check_inputs=False)


@pytest.mark.parametrize("device", device_params())
def test_kvcache_errors(device):
    dtype = dtype_for(device)
    q = rand((2, 1, 4, 64), device, dtype)
    k_cache = rand((2, 100, 2, 64), device, dtype)
    v_cache = rand((2, 100, 2, 64), device, dtype)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=device)
    kn = rand((2, 1, 2, 64), device, dtype)
    f = mala.attention_with_kvcache
    too_long = torch.tensor([10, 100], dtype=torch.int32, device=device)
    # Value checks of cache_seqlens / block_table are opt-in (a host synchronization).
    _raises(ValueError, "cache_seqlens", f, q, k_cache, v_cache, too_long, k=kn, v=kn, check_inputs=True)
    _raises(TypeError, "cache_seqlens", f, q, k_cache, v_cache, lens.long())
    _raises(ValueError, "cache_seqlens", f, q, k_cache, v_cache, lens[:1])
    _raises(ValueError, "v", f, q, k_cache, v_cache, lens, k=kn)
    _raises(ValueError, "v_cache", f, q, k_cache, v_cache[:, :50], lens)
    _raises(ValueError, "num_splits", f, q, k_cache, v_cache, lens, num_splits=-1)
    _raises(ValueError, "tau", f, q, k_cache, v_cache, lens, tau=-0.5)
    _raises(ValueError, "block_table", f, q, k_cache, v_cache, lens,
            block_table=torch.tensor([[0], [5]], dtype=torch.int32, device=device), check_inputs=True)
    _raises(ValueError, "split_rule", f, q, k_cache, v_cache, lens, split_rule="unsplit")
    if device == "cpu":
        # Without check_inputs the CPU implementation still checks what it reads on the host anyway.
        _raises(RuntimeError, "cache_seqlens", f, q, k_cache, v_cache, too_long, k=kn, v=kn)
        _raises(RuntimeError, "block_table", f, q, k_cache, v_cache, lens,
                block_table=torch.tensor([[0], [5]], dtype=torch.int32, device=device))


def test_lse_is_not_differentiable():
    q, k, v = (t.requires_grad_() for t in _qkv("cpu", n=16))
    out, lse = mala.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad

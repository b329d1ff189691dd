"""Bad input from issue #64, through the Python package, on the CPU and (skipped without a GPU) on
CUDA: varlen offsets past the tensors, num_splits, NaN queries, mixed devices, aliased caches and
the argument an error names.  What is checked where is in docs/python.md, "Validation"."""

import pytest
import torch

import mala
from mala.flash_attn_interface import flash_attn_varlen_func
from conftest import HAS_CUDA, device_params, dtype_for, rand

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")


def _raises(exc, name, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value).lstrip()
    # Our own checks start with the name; the library's come as "mala.<op>: <name>: ...".
    assert message.startswith(name + ":") or f": {name}:" in message, message
    return message


def _head_dim(device):
    return 64 if device == "cuda" else 16


# ---- D3: varlen offsets past q -------------------------------------------------------------------

@pytest.mark.parametrize("device", device_params())
def test_varlen_offsets_past_q_are_refused_with_check_inputs(device):
    d, dtype = _head_dim(device), dtype_for(device)
    q, k, v = (rand((10, 1, d), device, dtype) for _ in range(3))
    cu_q = torch.tensor([0, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 10], dtype=torch.int32, device=device)
    _raises(ValueError, "cu_seqlens_q", mala.attention_varlen, q, k, v, cu_q, cu_k, 12, 10, check_inputs=True)
    _raises(ValueError, "cu_seqlens_q", flash_attn_varlen_func, q, k, v, cu_q, cu_k, 12, 10, causal=True,
            check_inputs=True)


def test_varlen_offsets_past_q_are_refused_on_the_cpu_without_check_inputs():
    # flash_attn_varlen_func's default, check_inputs=False: the CPU library reads the offsets anyway
    # and now bounds them by q's rows (it read past q and wrote past out).
    q, k, v = (torch.randn(10, 1, 16) for _ in range(3))
    cu_q = torch.tensor([0, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 10], dtype=torch.int32)
    _raises((ValueError, RuntimeError), "cu_seqlens_q", flash_attn_varlen_func, q, k, v, cu_q, cu_k, 12, 10,
            causal=True)
    _raises((ValueError, RuntimeError), "cu_seqlens_k", flash_attn_varlen_func, q, k, v,
            torch.tensor([0, 10], dtype=torch.int32), torch.tensor([0, 12], dtype=torch.int32), 10, 12,
            causal=True)


@cuda_only
def test_varlen_offsets_within_the_tensors_run_on_cuda_without_check_inputs():
    # check_inputs=False on CUDA reads no offset on the host (no synchronization): offsets inside the
    # tensors are the caller's contract.  Fewer packed rows than the tensor holds is within it.
    q, k, v = (rand((40, 2, 64), "cuda", torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 16, 30], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out[:30].float()).all()


# ---- D2: num_splits -------------------------------------------------------------------------------

def _kvcache_inputs(device, cap=300, d=None, seed=0):
    d = d or _head_dim(device)
    g = torch.Generator().manual_seed(seed)
    dtype = dtype_for(device)
    q = torch.randn(1, 1, 1, d, generator=g).to(device, dtype)
    kc = torch.randn(1, cap, 1, d, generator=g).to(device, dtype)
    vc = torch.randn(1, cap, 1, d, generator=g).to(device, dtype)
    lens = torch.tensor([100], dtype=torch.int32, device=device)
    return q, kc, vc, lens


@pytest.mark.parametrize("device", device_params())
def test_num_splits_is_bounded(device):
    q, kc, vc, lens = _kvcache_inputs(device)
    for splits in (mala.api.MAX_NUM_SPLITS + 1, 2**31 - 1, 2**32):
        _raises(ValueError, "num_splits", mala.attention_with_kvcache, q, kc, vc, lens, num_splits=splits)
        # The operator itself (torch.compile's path) checks before narrowing to int: 2^32 became 0.
        _raises((ValueError, RuntimeError), "num_splits", torch.ops.mala.kvcache, q, kc, vc, lens, None, None, None,
                1.0, True, 0.0, splits, False)
    o, lse = mala.attention_with_kvcache(q, kc, vc, lens, num_splits=mala.api.MAX_NUM_SPLITS, return_lse=True)
    assert torch.isfinite(lse).all()


# ---- D1: NaN propagates ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_nan_query_gives_nan_in_decode(device, tau):
    q, kc, vc, lens = _kvcache_inputs(device)
    q[0, 0, 0, 0] = float("nan")
    for splits in (0, 1, 3):
        o, lse = mala.attention_with_kvcache(q, kc, vc, lens, tau=tau, num_splits=splits, return_lse=True)
        assert torch.isnan(o.float()).all(), (splits, o)
        assert torch.isnan(lse).all(), (splits, lse)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tau", [0.0, 1.0])
@pytest.mark.parametrize("n", [1, 200])
def test_nan_query_gives_nan_in_forward(device, tau, n):
    d, dtype = _head_dim(device), dtype_for(device)
    q, k, v = rand((1, n, 2, d), device, dtype), rand((1, n, 1, d), device, dtype), rand((1, n, 1, d), device, dtype)
    q[0, 0, 0, 0] = float("nan")  # one row of head 0
    q[0, :, 1, 3] = float("nan")  # all of head 1
    o, lse = mala.attention(q, k, v, tau=tau, return_lse=True)
    assert torch.isnan(o[0, 0, 0].float()).all()
    assert torch.isnan(lse[0, 0, 0])
    assert torch.isnan(lse[0, 1]).all(), lse[0, 1]
    assert torch.isnan(o[0, :, 1].float()).all()
    if n > 1:
        assert torch.isfinite(lse[0, 0, 1:]).all(), "finite rows of head 0 stay finite"


# ---- D4 and mixed devices --------------------------------------------------------------------------

@pytest.mark.parametrize("device", device_params())
def test_meta_tensor_mixed_with_real_ones_is_refused(device):
    d, dtype = _head_dim(device), dtype_for(device)
    q, k, v = (rand((1, 16, 1, d), device, dtype) for _ in range(3))
    _raises(ValueError, "k", mala.attention, q, k.to("meta"), v)
    _raises(ValueError, "v", mala.attention, q, k, v.to("meta"))
    qc, kc, vc, lens = _kvcache_inputs(device)
    _raises(ValueError, "v_cache", mala.attention_with_kvcache, qc, kc, vc.to("meta"), lens)


@cuda_only
def test_cpu_tensor_mixed_with_cuda_is_refused():
    q, k, v = (rand((1, 16, 1, 64), "cuda", torch.bfloat16) for _ in range(3))
    _raises(ValueError, "k", mala.attention, q, k.cpu(), v)
    qc, kc, vc, lens = _kvcache_inputs("cuda")
    _raises(ValueError, "cache_seqlens", mala.attention_with_kvcache, qc, kc, vc, lens.cpu())
    cu = torch.tensor([0, 16], dtype=torch.int32)
    _raises(ValueError, "cu_seqlens_q", mala.attention_varlen, q[0], k[0], v[0], cu, cu.cuda(), 16, 16,
            check_inputs=False)


# ---- D10: aliased caches when appending --------------------------------------------------------------

@pytest.mark.parametrize("device", device_params())
def test_appending_into_aliased_caches_is_refused(device):
    q, kc, _, lens = _kvcache_inputs(device)
    kn, vn = torch.randn_like(kc[:, :2]), torch.randn_like(kc[:, :2])
    before = kc.clone()
    _raises((ValueError, RuntimeError), "v_cache", mala.attention_with_kvcache, q, kc, kc, lens, k=kn, v=vn)
    assert torch.equal(kc, before), "the appended keys were written"
    # One cache read as both k and v, without appending, is allowed.
    mala.attention_with_kvcache(q, kc, kc, lens)


# ---- D11: the message names the caller's argument -----------------------------------------------------

@pytest.mark.parametrize("device", device_params())
def test_messages_name_the_callers_argument(device):
    d, dtype = _head_dim(device), dtype_for(device)
    q, k, v = (rand((1, 16, 1, d), device, dtype) for _ in range(3))
    _raises(TypeError, "tau", mala.attention, q, k, v, tau=None)
    qv, kv, vv = q[0], k[0], v[0]
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    _raises(ValueError, "max_seqlen_q", mala.attention_varlen, qv, kv, vv, cu, cu, 2**40, 16, check_inputs=False)
    _raises(ValueError, "max_seqlen_k", mala.attention_varlen, qv, kv, vv, cu, cu, 16, 2**40, check_inputs=False)


def test_transformers_register_checks_tau_as_attention_does():
    pytest.importorskip("transformers")
    import mala.integrations.transformers as mala_hf
    message = _raises(ValueError, "tau", mala_hf.make_attention_function, tau=float("nan"))
    assert "must be finite and >= 0" in message
    _raises(TypeError, "tau", mala_hf.make_attention_function, tau=None)

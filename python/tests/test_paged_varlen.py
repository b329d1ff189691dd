"""Paged K/V in mala.attention_varlen and flash_attn_varlen_func (block_table): the contiguous call on
the same keys, with the pages in a random order (outputs, lse, tile decisions, gradients)."""

import pytest
import torch

import mala
from conftest import device_params, dtype_for, local_inputs, rand
from mala.flash_attn_interface import flash_attn_varlen_func
from mala.paged import gather_paged_kv

# Unequal lengths with empty sequences (first, middle), one key length below its query length, a
# sequence ending exactly on a 16-key page and a 256-key one, an odd length and one key.
LENGTHS_Q = [0, 40, 300, 1, 0, 129]
LENGTHS_K = [0, 256, 300, 513, 0, 129]


def _raises(exc, name, fn, *args, **kwargs):
    """The call raises `exc` whose message names the argument first (ours) or after the operator's name
    (the library's, "mala.<op>: <name>: ...")."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value).lstrip()
    assert message.startswith(name + ":") or f": {name}:" in message, message


def _cu(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cu.to(device)


def _case(device, hq=4, hkv=2, d=64, seed=0, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    """Packed q, k, v cut from local inputs (so that tau = 1 skips tiles), and their offsets."""
    qs, ks, vs = [], [], []
    for i, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        q, k, v = local_inputs(device, 1, max(nq, nk, 1), hq, hkv, d, sharpness=2.0, seed=seed + i)
        qs.append(q[0, q.shape[1] - nq:])
        ks.append(k[0, :nk])
        vs.append(v[0, :nk])
    return (torch.cat(qs), torch.cat(ks), torch.cat(vs), _cu(lengths_q, device), _cu(lengths_k, device),
            max(lengths_q), max(lengths_k))


def _to_paged(k, v, cu_k, page_size, spare_pages=3, seed=0):
    """k/v [total_k, Hkv, d] -> pages [num_blocks, page_size, Hkv, d] in a random order (spare pages
    and the tail of each last page random, table padding -1) and block_table; also (page, slot) of
    every packed row, to scatter a contiguous gradient back."""
    g = torch.Generator().manual_seed(seed)
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    need = [-(-n // page_size) for n in lengths]
    num_blocks = sum(need) + spare_pages
    order = torch.randperm(num_blocks, generator=g).tolist()
    shape = (num_blocks, page_size) + tuple(k.shape[1:])
    kp = torch.randn(shape, generator=g).to(k.device, k.dtype)
    vp = torch.randn(shape, generator=g).to(v.device, v.dtype)
    table = torch.full((len(lengths), max(need + [1]) + 1), -1, dtype=torch.int32)
    where = []
    start = 0
    for b, n in enumerate(lengths):
        for j in range(need[b]):
            page = order.pop()
            table[b, j] = page
            rows = slice(start + j * page_size, start + min(n, (j + 1) * page_size))
            count = rows.stop - rows.start
            kp[page, :count], vp[page, :count] = k[rows], v[rows]
            where += [(page, s) for s in range(count)]
        start += n
    return kp, vp, table.to(k.device), where


def _scatter(grad_packed, where, like):
    """The contiguous call's dK (or dV) placed where the paged call keeps those keys: no page is shared
    here, so every used slot gets one row and the rest stays zero."""
    out = torch.zeros_like(like)
    for row, (page, slot) in enumerate(where):
        out[page, slot] = grad_packed[row]
    return out


def _tol(device):
    return dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=0.0, rtol=0.0)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tau", [0.0, 1.0])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_equals_contiguous(device, tau, causal, page_size):
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device)
    kp, vp, table, _ = _to_paged(k, v, cu_k, page_size, seed=page_size)
    args = (cu_q, cu_k, max_q, max_k)
    out, lse, stats = mala.attention_varlen(q, k, v, *args, tau=tau, causal=causal, return_lse=True,
                                            return_stats=True)
    out_p, lse_p, stats_p = mala.attention_varlen(q, kp, vp, *args, tau=tau, causal=causal, return_lse=True,
                                                  return_stats=True, block_table=table)
    # The same keys reach the same rule: the same decisions, and on the CPU the same bits.
    assert torch.equal(stats_p.fwd_slots, stats.fwd_slots)
    assert torch.equal(stats_p.fwd_tile_mask, stats.fwd_tile_mask)
    if tau > 0:
        dense = mala.attention_varlen(q, k, v, *args, tau=0.0, causal=causal, return_stats=True)[1]
        assert stats.fwd_slots.sum() < dense.fwd_slots.sum(), "the case skips no tile: decisions untested"
    torch.testing.assert_close(out_p, out, **_tol(device))
    torch.testing.assert_close(lse_p, lse, **(_tol(device) if device == "cuda" else {}), equal_nan=True)
    if device == "cpu":
        assert torch.equal(out_p, out) and torch.equal(lse_p, lse)
    # Without stats, and without the host checks, the same.
    out_n = mala.attention_varlen(q, kp, vp, *args, tau=tau, causal=causal, block_table=table, check_inputs=False)
    torch.testing.assert_close(out_n, out, **_tol(device))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("heads", [(4, 1), (4, 4)])
def test_paged_mqa_and_mha(device, heads):
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device, hq=heads[0], hkv=heads[1], seed=3)
    kp, vp, table, _ = _to_paged(k, v, cu_k, 16, seed=5)
    out = mala.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau=1.0)
    out_p = mala.attention_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, tau=1.0, block_table=table)
    torch.testing.assert_close(out_p, out, **_tol(device))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tau", [0.0, 1.0])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_gradients_are_contiguous_scattered(device, tau, causal):
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device, seed=7)
    kp, vp, table, where = _to_paged(k, v, cu_k, 16, seed=11)
    q, k, v, kp, vp = (t.detach().requires_grad_() for t in (q, k, v, kp, vp))
    args = (cu_q, cu_k, max_q, max_k)
    out = mala.attention_varlen(q, k, v, *args, tau=tau, causal=causal)
    out_p = mala.attention_varlen(q, kp, vp, *args, tau=tau, causal=causal, block_table=table)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    dq_p, dkp, dvp = torch.autograd.grad(out_p, (q, kp, vp), dout)
    assert dkp.shape == kp.shape and dvp.shape == vp.shape
    torch.testing.assert_close(dq_p, dq, **_tol(device))
    torch.testing.assert_close(dkp, _scatter(dk, where, kp), **_tol(device))
    torch.testing.assert_close(dvp, _scatter(dv, where, vp), **_tol(device))
    assert dk.abs().sum() > 0, "no gradient reached k: the comparison is empty"


def test_shared_page_gets_the_sum_of_its_gradients():
    """Two sequences reading one page (a shared prefix): its gradient is the sum of both sequences'."""
    q, k, v = (rand((32, 2, 64), "cpu", torch.float32) for _ in range(3))
    q, k, v = q.requires_grad_(), k[:16], v[:16]
    kp, vp = (t.reshape(1, 16, 2, 64).clone().requires_grad_() for t in (k, v))
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    table = torch.zeros((2, 1), dtype=torch.int32)
    out = mala.attention_varlen(q, kp, vp, cu, cu, 16, 16, tau=0.0, causal=True, block_table=table)
    dkp, = torch.autograd.grad(out.sum(), kp)
    k2 = torch.cat([k, k]).requires_grad_()
    out2 = mala.attention_varlen(q, k2, torch.cat([v, v]), cu, cu, 16, 16, tau=0.0, causal=True)
    dk2, = torch.autograd.grad(out2.sum(), k2)
    assert torch.equal(out, out2)
    torch.testing.assert_close(dkp[0], dk2[:16] + dk2[16:], atol=1e-6, rtol=1e-6)


class _HostCopy(Exception):
    pass


def _forbid_host_copies(monkeypatch):
    def refuse(*args, **kwargs):
        raise _HostCopy("host copy of a tensor")
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_gather_without_host_values(monkeypatch):
    """The gather CUDA runs without check_inputs: no index tensor read on the host, a bound on the
    rows, zeros past the last key; the contiguous call over it gives the same output and gradients
    (the rows past the last sequence send nothing back to the pages)."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case("cpu", seed=13)
    kp, vp, table, where = _to_paged(k, v, cu_k, 16, seed=17)
    kp, vp = kp.requires_grad_(), vp.requires_grad_()
    with monkeypatch.context() as m:
        _forbid_host_copies(m)
        kb, vb = gather_paged_kv(kp, vp, table, cu_k, max_k)
        with pytest.raises(_HostCopy):  # the spy works
            mala.attention_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, block_table=table)
    total = k.shape[0]
    assert kb.shape[0] == len(LENGTHS_K) * max_k > total
    assert torch.equal(kb[:total], k) and torch.equal(vb[:total], v)
    assert not kb[total:].any() and not vb[total:].any()
    out_b = mala.attention_varlen(q, kb, vb, cu_q, cu_k, max_q, max_k, tau=1.0, check_inputs=False)
    out = mala.attention_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, tau=1.0, block_table=table)
    assert torch.equal(out_b, out)
    dout = torch.randn_like(out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out_b, (kp, vp), dout),
                                                 torch.autograd.grad(out, (kp, vp), dout)))


@pytest.mark.parametrize("device", device_params())
def test_flash_attn_varlen_func_with_block_table(device):
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device, seed=19)
    kp, vp, table, _ = _to_paged(k, v, cu_k, 256, seed=23)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, tau=0.0)
    out_p = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max_q, max_k, block_table=table, tau=0.0)
    torch.testing.assert_close(out_p, out, **_tol(device))
    out_c, lse, probs = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max_q, max_k, causal=True,
                                               return_attn_probs=True, block_table=table, tau=0.0)
    ref = mala.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau=0.0, causal=True)
    assert probs is None and lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(out_c, ref, **_tol(device))


@pytest.mark.parametrize("device", device_params())
def test_paged_argument_errors(device):
    dtype = dtype_for(device)
    q = rand((40, 4, 64), device, dtype)
    kp, vp = rand((3, 16, 2, 64), device, dtype), rand((3, 16, 2, 64), device, dtype)
    cu_q = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 20, 30], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=device)
    kp0, vp0 = kp.clone(), vp.clone()

    def call(k=kp, v=vp, block_table=table, cu_seqlens_k=cu_k, check_inputs=True, **kw):
        return mala.attention_varlen(q, k, v, cu_q, cu_seqlens_k, 20, 20, block_table=block_table,
                                     check_inputs=check_inputs, **kw)

    call()  # the valid call: -1 past a sequence's used pages is padding, not read
    _raises(ValueError, "block_table", call, block_table=table.long())
    _raises(ValueError, "block_table", call, block_table=table[0])
    _raises(ValueError, "block_table", call, block_table=table[:1])
    _raises(TypeError, "block_table", call, block_table=[[0, 1], [2, 0]])
    _raises(ValueError, "block_table", call, block_table=table.to("meta"))
    _raises(ValueError, "k", call, k=kp.flatten(0, 1))
    _raises(ValueError, "v", call, v=vp[:, :8])
    _raises(ValueError, "v", call, v=vp[:2])
    _raises(ValueError, "cu_seqlens_k", call, cu_seqlens_k=cu_k.long())
    _raises(ValueError, "block_table", call, block_table=torch.tensor([[0, 3], [2, 0]], dtype=torch.int32,
                                                                      device=device))
    _raises(ValueError, "block_table", call, block_table=torch.tensor([[0, -1], [2, 0]], dtype=torch.int32,
                                                                       device=device))
    # 40 keys in sequence 1 need 3 pages of 16; the table has 2 per sequence.
    _raises(ValueError, "cu_seqlens_k", mala.attention_varlen, q, kp, vp, cu_q,
            torch.tensor([0, 20, 60], dtype=torch.int32, device=device), 20, 40, block_table=table)
    _raises(ValueError, "cu_seqlens_k", call, cu_seqlens_k=torch.tensor([0, 30, 20], dtype=torch.int32,
                                                                         device=device))
    _raises(ValueError, "cu_seqlens_k", call, cu_seqlens_k=torch.tensor([0, 25, 30], dtype=torch.int32,
                                                                         device=device))  # 25 > max_seqlen_k
    # The flash_attn shim does not synchronize by default, but the CPU checks the values anyway.
    if device == "cpu":
        _raises(ValueError, "block_table", flash_attn_varlen_func, q, kp, vp, cu_q, cu_k, 20, 20,
                block_table=torch.tensor([[0, 9], [2, 0]], dtype=torch.int32))
    assert torch.equal(kp, kp0) and torch.equal(vp, vp0), "the paged tensors were written"


@pytest.mark.parametrize("device", device_params(cpu=False))
def test_paged_padded_head_dim(device):
    """A head dim of no CUDA kernel (80) is padded after the gather, on the used keys only."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device, d=80, seed=29)
    kp, vp, table, _ = _to_paged(k, v, cu_k, 16, seed=31)
    out = mala.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau=1.0)
    out_p = mala.attention_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, tau=1.0, block_table=table)
    assert out_p.shape == q.shape
    torch.testing.assert_close(out_p, out, **_tol(device))


@pytest.mark.parametrize("device", device_params())
def test_paged_views_of_a_joint_cache(device):
    """k/v as views of one [num_blocks, 2, page_size, Hkv, d] cache (page dims that cannot be
    flattened without a copy), as engines that keep K and V together pass them."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device, seed=37)
    kp, vp, table, _ = _to_paged(k, v, cu_k, 16, seed=41)
    joint = torch.stack([kp, vp], dim=1)
    out = mala.attention_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, tau=1.0, block_table=table)
    out_j = mala.attention_varlen(q, joint[:, 0], joint[:, 1], cu_q, cu_k, max_q, max_k, tau=1.0,
                                  block_table=table)
    assert torch.equal(out_j, out)


@pytest.mark.parametrize("device", device_params(cpu=False))
def test_cuda_default_call_does_not_read_indices_on_host(device, monkeypatch):
    """flash_attn_varlen_func's default (check_inputs=False) gathers the pages without a host copy of
    block_table or cu_seqlens_k; check_inputs=True reads them (the spy works)."""
    q, k, v, cu_q, cu_k, max_q, max_k = _case(device, seed=43)
    kp, vp, table, _ = _to_paged(k, v, cu_k, 16, seed=47)
    ref = mala.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau=1.0, causal=True)
    with monkeypatch.context() as m:
        _forbid_host_copies(m)
        out = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max_q, max_k, causal=True, block_table=table, tau=1.0)
        with pytest.raises(_HostCopy):
            flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max_q, max_k, causal=True, block_table=table, tau=1.0,
                                   check_inputs=True)
    torch.testing.assert_close(out, ref, **_tol(device))

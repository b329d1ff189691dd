"""mala.attention: tau = 0 equals dense attention (outputs and gradients), tau = 1 obeys the bound."""

import math

import pytest
import torch
import torch.nn.functional as F

import mala
from conftest import (assert_close_to_reference, device_params, dtype_for, local_inputs, max_err, rand,
                      reference_attention, rel_l2)

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal)
SHAPES = [
    (2, 256, 256, 4, 4, 64, True),     # MHA
    (1, 333, 333, 8, 1, 128, True),    # MQA (the paper's per-rank GQA ratio), odd length
    (2, 200, 200, 4, 2, 64, False),    # GQA, non-causal
    (1, 77, 301, 4, 2, 128, True),     # fewer queries than keys: bottom-right diagonal
    (1, 300, 100, 2, 1, 64, True),     # more queries than keys: the first 200 rows see nothing
    (1, 129, 129, 2, 2, 256, True),    # head_dim 256
]
CPU_SHAPES = [s for s in SHAPES if s[1] * s[2] <= 70000]


def _inputs(device, shape, seed=0):
    batch, nq, nk, hq, hkv, d, _ = shape
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = dtype_for(device)
    q = rand((batch, nq, hq, d), device, dtype, generator=g).requires_grad_()
    k = rand((batch, nk, hkv, d), device, dtype, generator=g).requires_grad_()
    v = rand((batch, nk, hkv, d), device, dtype, generator=g).requires_grad_()
    dout = rand((batch, nq, hq, d), device, dtype, generator=g)
    return q, k, v, dout


def _shapes(device):
    return SHAPES if device == "cuda" else CPU_SHAPES


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("shape_index", range(len(SHAPES)))
def test_tau0_matches_dense_reference(device, shape_index):
    shape = SHAPES[shape_index]
    if shape not in _shapes(device):
        pytest.skip("shape too large for the CPU implementation")
    causal = shape[-1]
    q, k, v, dout = _inputs(device, shape)
    out, lse = mala.attention(q, k, v, tau=0.0, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_lse = reference_attention(q, k, v, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    low, _ = reference_attention(q, k, v, causal, upcast=False)
    low_grads = torch.autograd.grad(low, (q, k, v), dout)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (shape[0], shape[3], shape[1]) and lse.dtype == torch.float32
    assert_close_to_reference(out, ref, low, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf exactly on rows that see no key"
    assert max_err(lse[finite], ref_lse[finite]) < 1e-2
    for name, g, rg, lg in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert g.shape == rg.shape and g.dtype == q.dtype
        assert_close_to_reference(g, rg, lg, name)


@pytest.mark.parametrize("device", device_params())
def test_tau0_matches_sdpa(device):
    """Same inputs through torch's SDPA (is_causal, enable_gqa) in the same precision."""
    q, k, v, dout = _inputs(device, (2, 256, 256, 8, 2, 64, True), seed=3)
    out = mala.attention(q, k, v, tau=0.0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), dout)
    tol = dict(atol=2e-2, rtol=2e-2) if q.dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, sdpa, **tol)
    for g, sg in zip(grads, sdpa_grads):
        assert rel_l2(g, sg) < (2e-2 if q.dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("tau", [0.25, 1.0, 4.0])
def test_tau_error_within_bound(device, tau):
    n = 2048 if device == "cuda" else 512
    q, k, v = local_inputs(device, 1, n, 4, 1, 64, sharpness=1.0, seed=1)
    out, lse, stats = mala.attention(q, k, v, tau=tau, return_lse=True, return_stats=True)
    ref, ref_lse = reference_attention(q, k, v, True)
    # Something must have been skipped, or the bound below proves nothing.
    assert stats.fwd_retained_fraction < 1.0, "tau > 0 on sharp inputs should skip tiles"
    # Omitted mass per row: eps = 1 - exp(lse - lse_dense) <= tau / (1 + tau) (Appendix B).
    omitted = 1.0 - torch.exp(lse - ref_lse)
    bound = tau / (1.0 + tau)
    slack = 2e-2  # bf16 inputs, fp32 state
    assert omitted.min().item() > -slack, "MALA cannot hold more mass than dense attention"
    assert omitted.max().item() <= bound + slack, f"omitted mass {omitted.max().item():.3f} > tau/(1+tau) = {bound:.3f}"
    # Output per row: |o - o_dense| <= ||p - p~||_1 * max|v| = 2 eps max|v|.
    row_err = (out.float() - ref).abs().amax(dim=-1).transpose(1, 2)  # [B, H, N]
    vmax = v.float().abs().max().item()
    assert (row_err <= 2 * omitted.clamp(min=0) * vmax + 3e-2).all()
    # And tau = 0 on the same inputs is dense (nothing skipped).
    _, stats0 = mala.attention(q, k, v, tau=0.0, return_stats=True)
    assert stats0.fwd_retained_fraction == 1.0


@pytest.mark.parametrize("device", device_params())
def test_tau1_gradients_close_to_dense(device):
    """Backward with tau = 1 stays close to dense on local inputs, and reports its (nested) work."""
    n = 2048 if device == "cuda" else 512
    q, k, v = local_inputs(device, 1, n, 4, 2, 64, sharpness=2.0, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    out, stats = mala.attention(q, k, v, tau=1.0, return_stats=True)
    assert stats.bwd_slots is None
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = reference_attention(q, k, v, True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert rel_l2(g, rg) < 0.5, f"{name}: relative error {rel_l2(g, rg):.3f} vs dense"
    assert stats.fwd_retained_fraction < 1.0, "tau = 1 on local inputs should skip tiles"
    assert stats.bwd_slots is not None and stats.bwd_slots.shape == stats.fwd_slots.shape
    assert stats.bwd_retained_fraction <= 1.0
    assert (stats.bwd_slots % stats.bwd_block_k == 0).all() and (stats.fwd_slots % stats.fwd_block_k == 0).all()
    if (stats.fwd_block_q, stats.fwd_block_k) == (stats.bwd_block_q, stats.bwd_block_k):
        # Same tiles: backward support is nested in forward support (rounding flips aside).
        assert stats.bwd_retained_fraction <= stats.fwd_retained_fraction + 0.01


@pytest.mark.parametrize("device", device_params())
def test_stats_slots_match_definition(device):
    """fwd_slots at tau = 0 is block_k times the number of legal key tiles of each row."""
    q, k, v, _ = _inputs(device, (1, 300, 300, 2, 1, 64, True))
    _, stats = mala.attention(q.detach(), k.detach(), v.detach(), tau=0.0, return_stats=True)
    bq, bk = stats.fwd_block_q, stats.fwd_block_k
    rows = torch.arange(300, device=device)
    # The query tile of row r spans rows [r0, r0 + bq); its last row sees keys <= min(r0 + bq - 1, 299).
    last_row = torch.clamp((rows // bq + 1) * bq - 1, max=299)
    expected = (last_row // bk + 1) * bk
    assert torch.equal(stats.fwd_slots[0, 0].long(), expected.long())
    assert stats.mean_fwd_slots == pytest.approx(expected.double().mean().item())


@pytest.mark.parametrize("device", device_params())
def test_stats_under_activation_checkpointing(device):
    """return_stats inside torch.utils.checkpoint (non-reentrant, as transformers' gradient
    checkpointing uses): the backward reads its saved tensors once (a second read raises there),
    gives the plain call's gradients and fills the backward stats."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, _ = _inputs(device, (1, 300, 300, 2, 1, 64, True))
    box = []

    def attend(q, k, v):
        out, stats = mala.attention(q, k, v, tau=1.0, return_stats=True)
        box.append(stats)
        return out

    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    checkpoint(attend, qa, ka, va, use_reentrant=False).sum().backward()
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    mala.attention(qb, kb, vb, tau=1.0).sum().backward()
    for a, b in ((qa, qb), (ka, kb), (va, vb)):
        assert torch.equal(a.grad, b.grad)
    # (Whether the recomputation calls attend again is torch's choice; the last stats saw the backward.)
    assert box[-1].bwd_slots is not None and box[-1].mean_bwd_slots > 0


@pytest.mark.parametrize("device", device_params())
def test_strided_inputs_need_no_copy(device):
    """[B, H, N, d] tensors transposed to [B, N, H, d] (the transformers layout) are accepted."""
    q, k, v, _ = _inputs(device, (2, 128, 128, 4, 2, 64, True))
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    out = mala.attention(qt, kt, vt, tau=0.0)
    torch.testing.assert_close(out, mala.attention(q.detach(), k.detach(), v.detach(), tau=0.0), atol=0, rtol=0)


@pytest.mark.parametrize("device", device_params())
def test_softmax_scale(device):
    q, k, v, _ = _inputs(device, (1, 128, 128, 2, 2, 64, True))
    q, k, v = q.detach(), k.detach(), v.detach()
    out = mala.attention(q, k, v, tau=0.0, softmax_scale=0.3)
    ref, _ = reference_attention(q, k, v, True, softmax_scale=0.3)
    assert rel_l2(out, ref) < 1e-2
    assert rel_l2(mala.attention(q, k, v, tau=0.0, softmax_scale=1 / math.sqrt(64)), mala.attention(q, k, v, tau=0.0)) == 0


def _sm90(device):
    return device == "cuda" and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("device", device_params())
def test_forward_mask_tiles_says_where_the_backward_reads_it(device):
    """torch.ops.mala.forward_mask_tiles: the forward's tiles where the backward reads the forward's
    tile mask (the Hopper backward at d = 64 and 128, tau > 0, deterministic or not: the deterministic
    mode's fixed-point dQ adds need no order), else []."""
    dtype = dtype_for(device)
    ask = lambda d, tau, det: torch.ops.mala.forward_mask_tiles(torch.device(device), dtype, 1, 4096, 4096, 8, 1,
                                                                d, True, tau, det)
    if not _sm90(device):
        assert ask(128, 1.0, False) == []
        return
    bq, bk = torch.ops.mala.tile_sizes("forward", torch.device(device), dtype, 1, 4096, 4096, 8, 1, 128, True, 0)[:2]
    assert ask(128, 1.0, False) == [bq, bk]
    assert ask(64, 1.0, False) != []
    assert ask(256, 1.0, False) == []
    assert ask(128, 0.0, False) == []
    assert ask(128, 1.0, True) == [bq, bk]
    assert ask(64, 1.0, True) != []


@pytest.mark.parametrize("device", device_params())
def test_backward_takes_the_forward_tile_mask(device):
    """A forward that will be differentiated records its tile mask where the backward reads it, and
    autograd hands it to the backward, which then skips the tiles the forward skipped without scoring
    them: the same backward decisions (up to rounding flips at the threshold) and gradients as a
    backward that scores every tile."""
    n = 2048 if device == "cuda" else 384
    q, k, v = local_inputs(device, 1, n, 4, 1, 128, sharpness=4.0, seed=3)
    dout = torch.randn_like(q)
    out, lse, slots, fwd_mask = torch.ops.mala.fwd(q, k, v, 1.0, True, 0.0, False, False, True)
    assert slots.numel() == 0
    tiles = torch.ops.mala.forward_mask_tiles(q.device, q.dtype, 1, n, n, 4, 1, 128, True, 1.0, False)
    assert bool(tiles) == _sm90(device)
    if not tiles:
        assert fwd_mask.numel() == 0
    else:
        assert fwd_mask.shape == (1, 4, -(-n // tiles[0]), -(-n // tiles[1]))
        assert (fwd_mask == mala.stats.TILE_SKIPPED).any() and (fwd_mask == mala.stats.TILE_RETAINED).any()
        # The recorded mask is the stats' (the same forward, with or without slots).
        _, _, _, stats_mask = torch.ops.mala.fwd(q, k, v, 1.0, True, 0.0, True)
        assert torch.equal(fwd_mask, stats_mask)
    with_mask = torch.ops.mala.bwd(dout, q, k, v, out, lse, 1.0, True, 0.0, True, False, fwd_mask)
    scored = torch.ops.mala.bwd(dout, q, k, v, out, lse, 1.0, True, 0.0, True, False)
    kept_a = with_mask[4] == mala.stats.TILE_RETAINED
    kept_b = scored[4] == mala.stats.TILE_RETAINED
    assert (kept_a != kept_b).float().mean().item() <= 0.002, "decisions differ beyond rounding flips"
    assert (scored[4] == mala.stats.TILE_SKIPPED).any(), "these inputs should skip backward tiles"
    for name, a, b in zip(("dq", "dk", "dv"), with_mask[:3], scored[:3]):
        assert rel_l2(a, b) < 1e-2, f"{name}: {rel_l2(a, b):.2e}"
    # Autograd: mala.attention's backward is the masked one.
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(mala.attention(qa, ka, va, tau=1.0), (qa, ka, va), dout)
    for name, a, b in zip(("dq", "dk", "dv"), grads, with_mask[:3]):
        assert rel_l2(a, b) < 1e-2, f"{name}: {rel_l2(a, b):.2e}"
    # And so is the stats path's, which reports it.
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
    out_b, stats = mala.attention(qb, kb, vb, tau=1.0, return_stats=True)
    out_b.backward(dout)
    assert (stats.bwd_tile_mask.shape == with_mask[4].shape)
    assert ((stats.bwd_tile_mask == mala.stats.TILE_RETAINED) != kept_a).float().mean().item() <= 0.002


def test_forward_tile_mask_errors_name_the_argument():
    q, k, v = local_inputs("cpu", 1, 64, 2, 1, 64)
    out, lse, _, _ = torch.ops.mala.fwd(q, k, v, 1.0, True, 0.0, False)
    with pytest.raises(ValueError, match="fwd_tile_mask: must be the forward's tile mask of shape"):
        torch.ops.mala.bwd(out, q, k, v, out, lse, 1.0, True, 0.0, False, False,
                           torch.zeros((1, 2, 3, 3), dtype=torch.uint8))
    with pytest.raises(TypeError, match="fwd_tile_mask: dtype must be uint8"):
        torch.ops.mala.bwd(out, q, k, v, out, lse, 1.0, True, 0.0, False, False,
                           torch.zeros((1, 2, 1, 1), dtype=torch.int32))

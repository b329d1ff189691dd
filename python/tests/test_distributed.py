"""mala.distributed (context parallelism): the zig-zag ring on CPU gloo process groups of 2 and 4
ranks against single-process references.

- tau = 0: outputs, lse and gradients equal dense attention (float64).
- tau = 1 on a sharp input (local attention and a sink: many tiles are skipped): outputs, lse,
  gradients and the realized slots equal an independent float64 reference of the same split
  schedule (splits = the 2W chunks, the seeded rule with global L_q, the offline backward against
  the final lse); the omitted mass obeys the bound tau / (1 + tau).
- The schedule reference with one split equals the library's single call (torch.ops.mala.fwd/bwd).
- The split operators torch.ops.mala.fwd_split / bwd_split equal their float64 reference call by call.
- Argument errors name the argument.

The references below are plain PyTorch in float64, written from docs/spec.md ("Split rules",
"Work accounting") and the operator contract of torch.ops.mala.fwd_split / bwd_split, independently
of mala/distributed.py (the schedule reference works on the full sequence in global tile indices).
"""

import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mala  # noqa: F401  (registers torch.ops.mala.*)
import mala.distributed as mcp
from conftest import local_inputs

ILLEGAL, SKIPPED, RETAINED = 0, 1, 2
FLIP_MARGIN = 1e-3  # docs/spec.md: a tile whose margin is below this may flip between implementations


# ---- float64 references of the split operators ---------------------------------------------------

def _dense_scores(q, k, scale, causal):
    """fp64 scores [B, Hq, Nq, Nk] (GQA expanded), legal-key mask [Nq, Nk], visible keys per row."""
    nq, nk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    kd = k.double().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kd) * scale
    rows = torch.arange(nq)
    visible = (rows + nk - nq + 1).clamp(0, nk) if causal else torch.full((nq,), nk)
    legal = torch.arange(nk)[None, :] < visible[:, None]
    return scores.masked_fill(~legal, float("-inf")), legal, visible


def _log_thresholds(tau, rows_before, visible):
    """log(tau) - log(L_q) per row, L_q = rows_before + r + 1 (or the visible keys when rows_before < 0)."""
    n = visible.numel()
    L = (rows_before + torch.arange(n) + 1) if rows_before >= 0 else visible
    log_tau = math.log(tau) if tau > 0 else float("-inf")
    return log_tau - torch.log(L.double().clamp(min=1))


def ref_fwd_split64(q, k, v, seed_lse, rows_before, owns_tile0, owns_newest, tau, causal, scale, block_q, block_k):
    """The forward split in float64.  Returns out [B, Nq, Hq, d] and lse [B, Hq, Nq] (fp64), retained
    tiles per query tile [B, Hq, nqt], the tile mask [B, Hq, nqt, nkt] (uint8) and, per query tile,
    the smallest |margin| of a tested tile (inf if none was tested)."""
    batch, nq, hq, d = q.shape
    nk, group = k.shape[1], hq // k.shape[2]
    scores, legal, visible = _dense_scores(q, k, scale, causal)
    vd = v.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [B, Hq, Nk, d]
    log_thr = _log_thresholds(tau, rows_before, visible)
    seed = None if seed_lse is None else seed_lse.double()
    nqt, nkt = -(-nq // block_q), -(-nk // block_k)
    out = torch.zeros(batch, hq, nq, d, dtype=torch.float64)
    lse = torch.full((batch, hq, nq), float("-inf"), dtype=torch.float64)
    retained = torch.zeros(batch, hq, nqt, dtype=torch.int64)
    mask = torch.full((batch, hq, nqt, nkt), ILLEGAL, dtype=torch.uint8)
    margin = torch.full((batch, hq, nqt), float("inf"), dtype=torch.float64)
    for i in range(nqt):
        r0, r1 = i * block_q, min(nq, (i + 1) * block_q)
        vis = visible[r0:r1]
        if int(vis.max()) == 0:
            continue
        seen = vis[vis > 0]
        newest_lo, newest_hi = (int(seen.min()) - 1) // block_k, (int(seen.max()) - 1) // block_k
        m = torch.full((batch, hq, r1 - r0), float("-inf"), dtype=torch.float64)
        l = torch.zeros_like(m)
        acc = torch.zeros(batch, hq, r1 - r0, d, dtype=torch.float64)
        for j in reversed(range(-(-int(vis.max()) // block_k))):  # legal tiles, newest first
            c0, c1 = j * block_k, min(nk, (j + 1) * block_k)
            s = scores[:, :, r0:r1, c0:c1]
            row_legal = legal[r0:r1, c0:c1].any(-1)
            tile_max = s.amax(-1)
            forced = seed is not None and ((j == 0 and owns_tile0) or (owns_newest and newest_lo <= j <= newest_hi))
            if forced:
                keep = torch.ones(batch, hq, dtype=torch.bool)
            else:
                own = m + torch.log(l)
                norm = own if seed is None else torch.logaddexp(seed[:, :, r0:r1], own)
                row_margin = torch.where(row_legal, tile_max - norm - log_thr[r0:r1], float("-inf"))
                tile_margin = row_margin.amax(-1)
                keep = tile_margin >= 0
                finite = torch.isfinite(tile_margin)
                margin[:, :, i] = torch.where(finite, torch.minimum(margin[:, :, i], tile_margin.abs()),
                                              margin[:, :, i])
            mask[:, :, i, j] = torch.where(keep, RETAINED, SKIPPED).to(torch.uint8)
            retained[:, :, i] += keep.long()
            m_new = torch.maximum(m, tile_max)
            safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = torch.exp(s - safe[..., None])
            alpha = torch.exp(m - safe)
            kp = keep[:, :, None]
            l = torch.where(kp, alpha * l + p.sum(-1), l)
            acc = torch.where(kp[..., None], alpha[..., None] * acc + p @ vd[:, :, c0:c1], acc)
            m = torch.where(kp, m_new, m)
        has = l > 0
        out[:, :, r0:r1] = torch.where(has[..., None], acc / l.clamp(min=1e-300)[..., None], 0.0)
        lse[:, :, r0:r1] = torch.where(has, m + torch.log(l.clamp(min=1e-300)), float("-inf"))
    return out.permute(0, 2, 1, 3), lse, retained, mask, margin


def ref_bwd_split64(dout, q, k, v, out, lse, rows_before, tau, causal, scale, block_q, block_k):
    """The backward split in float64 (offline test against the final lse).  Returns dq, dk, dv
    (fp64), retained tiles per query tile [B, Hq, nqt], the tile mask and the smallest |margin| of a
    legal tile per query tile."""
    batch, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scores, legal, visible = _dense_scores(q, k, scale, causal)
    log_thr = _log_thresholds(tau, rows_before, visible)
    lse = lse.double()
    nqt, nkt = -(-nq // block_q), -(-nk // block_k)
    entry = torch.where(legal, scores - lse[..., None] - log_thr[:, None], float("-inf"))
    pad = (0, nkt * block_k - nk, 0, nqt * block_q - nq)
    tiles = torch.nn.functional.pad(entry, pad, value=float("-inf"))
    tile_margin = tiles.view(batch, hq, nqt, block_q, nkt, block_k).amax(dim=(3, 5))
    legal_tile = torch.nn.functional.pad(legal, pad, value=False).view(nqt, block_q, nkt, block_k).any(3).any(1)
    keep = legal_tile & (tile_margin >= 0)
    mask = torch.where(keep, RETAINED, torch.where(legal_tile, SKIPPED, ILLEGAL)).to(torch.uint8)
    margin = torch.where(legal_tile, tile_margin.abs(), float("inf")).amin(-1)
    keep_entries = keep.repeat_interleave(block_q, 2)[:, :, :nq].repeat_interleave(block_k, 3)[..., :nk] & legal
    p = torch.where(keep_entries, torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    qd = q.double().permute(0, 2, 1, 3)
    kd = k.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    vd = v.double().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    do = dout.double().permute(0, 2, 1, 3)
    delta = (do * out.double().permute(0, 2, 1, 3)).sum(-1)
    ds = p * (do @ vd.transpose(-1, -2) - delta[..., None])
    dq = scale * ds @ kd
    dk = (scale * ds.transpose(-1, -2) @ qd).view(batch, hkv, group, nk, d).sum(2)
    dv = (p.transpose(-1, -2) @ do).view(batch, hkv, group, nk, d).sum(2)
    return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3), keep.sum(-1), mask, margin


def _resolve_scale(softmax_scale, d):
    return softmax_scale if softmax_scale else 1.0 / math.sqrt(d)


def _row_slots(retained, block_q, block_k, nq, nk, causal):
    """[B, Hq, Nq]: block_k per retained tile of the row's query tile; 0 for rows that see no key."""
    rows = torch.arange(nq)
    visible = (rows + nk - nq + 1).clamp(0, nk) if causal else torch.full((nq,), nk)
    return (retained * block_k).repeat_interleave(block_q, 2)[:, :, :nq] * (visible > 0)


# ---- float64 reference of the whole split schedule ----------------------------------------------

def _anchor_seed(scores_full, p0, chunk, b, block_q, block_k):
    """log of the mass, per row of the query chunk starting at global row p0, of the anchor tiles
    that key chunk b does not hold: key tile 0 and the newest tiles of the row's query tile, over the
    row's legal keys.  Also whether chunk b holds key tile 0 / all of the newest tiles."""
    n = p0 + chunk  # keys after the chunk's last row are illegal for all of its rows
    rows = torch.arange(p0, p0 + chunk)
    key_tile = torch.arange(n) // block_k
    first_row = rows // block_q * block_q                       # the query tile's rows: all valid
    newest_lo, newest_hi = first_row // block_k, (first_row + block_q - 1) // block_k
    anchor = (key_tile[None, :] == 0) | ((key_tile[None, :] >= newest_lo[:, None]) &
                                         (key_tile[None, :] <= newest_hi[:, None]))
    held = (torch.arange(n) >= b * chunk) & (torch.arange(n) < (b + 1) * chunk)
    legal = torch.arange(n)[None, :] <= rows[:, None]
    counted = anchor & ~held & legal
    cols = counted.any(0).nonzero().flatten()  # only the columns that count for some row
    seed = torch.logsumexp(scores_full[:, :, p0:p0 + chunk, cols].masked_fill(~counted[:, cols], float("-inf")),
                           dim=-1)
    newest_held = (anchor & (key_tile[None, :] > 0))[:, held]
    owns_newest = bool(newest_held.sum(-1).eq((anchor & (key_tile[None, :] > 0)).sum(-1)).all())
    return seed, bool(held[0]), owns_newest


def ref_schedule(q, k, v, dout, chunk, tau, softmax_scale, fwd_tiles, bwd_tiles, seeded=True, backward=True):
    """The context-parallel schedule on the full sequence in float64: every (query chunk a, key chunk
    b <= a) is one split; seeds, merge and offline backward as docs/spec.md.  Returns a dict with out,
    lse, dq, dk, dv (fp64), fwd_slots/bwd_slots [B, Hq, N] and, per row, the smallest forward and
    backward |margin| of its query tile (for the rounding-flip allowance), and the [retained, legal]
    tile counts fwd_tiles / bwd_tiles.  seeded=False: the paper's per-split rule (no seeds, nothing
    forced), to show that the seeds matter on a test input.  backward=False: the forward only."""
    batch, n, hq, d = q.shape
    scale = _resolve_scale(softmax_scale, d)
    fq, fk = fwd_tiles
    bq, bk = bwd_tiles
    scores_full, _, _ = _dense_scores(q, k, scale, True)
    out = torch.zeros(batch, n, hq, d, dtype=torch.float64)
    lse = torch.full((batch, hq, n), float("-inf"), dtype=torch.float64)
    fwd_slots = torch.zeros(batch, hq, n, dtype=torch.int64)
    bwd_slots = torch.zeros_like(fwd_slots)
    fwd_margin = torch.full((batch, hq, n), float("inf"), dtype=torch.float64)
    bwd_margin = torch.full_like(fwd_margin, float("inf"))
    dq = torch.zeros(batch, n, hq, d, dtype=torch.float64)
    dk = torch.zeros(batch, n, k.shape[2], d, dtype=torch.float64)
    dv = torch.zeros_like(dk)
    tiles = {"fwd": [0, 0], "bwd": [0, 0]}  # [retained, legal]

    def count(kind, mask):
        tiles[kind][0] += int((mask == RETAINED).sum())
        tiles[kind][1] += int((mask != ILLEGAL).sum())

    n_chunks = n // chunk
    for a in range(n_chunks):
        rows = slice(a * chunk, (a + 1) * chunk)
        for b in range(a + 1):
            keys = slice(b * chunk, (b + 1) * chunk)
            if a == 0 or not seeded:  # one split (a = 0), or the per-split rule: no seed, nothing forced
                seed, owns0, owns_new = None, False, False
            else:
                seed, owns0, owns_new = _anchor_seed(scores_full, a * chunk, chunk, b, fq, fk)
            o_s, l_s, kept, mask, marg = ref_fwd_split64(q[:, rows], k[:, keys], v[:, keys], seed, a * chunk, owns0,
                                                      owns_new, tau, a == b, scale, fq, fk)
            count("fwd", mask)
            new = torch.logaddexp(lse[:, :, rows], l_s)
            ref = torch.where(torch.isinf(new), 0.0, new)
            w_acc = torch.exp(lse[:, :, rows] - ref).transpose(1, 2)[..., None]
            w_s = torch.exp(l_s - ref).transpose(1, 2)[..., None]
            out[:, rows] = out[:, rows] * w_acc + o_s * w_s
            lse[:, :, rows] = new
            fwd_slots[:, :, rows] += (kept * fk).repeat_interleave(fq, 2)
            fwd_margin[:, :, rows] = torch.minimum(fwd_margin[:, :, rows], marg.repeat_interleave(fq, 2))
    for a in range(n_chunks if backward else 0):
        rows = slice(a * chunk, (a + 1) * chunk)
        for b in range(a + 1):
            keys = slice(b * chunk, (b + 1) * chunk)
            g_q, g_k, g_v, kept, mask, marg = ref_bwd_split64(dout[:, rows], q[:, rows], k[:, keys], v[:, keys],
                                                           out[:, rows], lse[:, :, rows], a * chunk, tau, a == b,
                                                           scale, bq, bk)
            count("bwd", mask)
            dq[:, rows] += g_q
            dk[:, keys] += g_k
            dv[:, keys] += g_v
            bwd_slots[:, :, rows] += (kept * bk).repeat_interleave(bq, 2)
            bwd_margin[:, :, rows] = torch.minimum(bwd_margin[:, :, rows], marg.repeat_interleave(bq, 2))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, fwd_slots=fwd_slots, bwd_slots=bwd_slots,
                fwd_margin=fwd_margin, bwd_margin=bwd_margin, fwd_tiles=tiles["fwd"], bwd_tiles=tiles["bwd"])


def dense64(q, k, v, dout, softmax_scale=None):
    """Causal dense attention in float64: out, lse, dq, dk, dv."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores, _, _ = _dense_scores(q, k, _resolve_scale(softmax_scale, q.shape[3]), True)
    lse = torch.logsumexp(scores, -1)
    group = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v.repeat_interleave(group, dim=2))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.double())
    return dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


# ---- inputs and the spawned ring ----------------------------------------------------------------

# name -> (batch, heads_q, heads_kv, head_dim, chunk, tau, softmax_scale, (fwd block_q, block_k),
#          (bwd block_q, block_k), sharp input)
CASES = {
    "dense": (2, 4, 2, 32, 32, 0.0, 0.2, (16, 16), (16, 16), False),
    "sharp": (1, 4, 1, 16, 64, 1.0, None, (32, 16), (16, 32), True),
}
WORLD_SIZES = (2, 4)


def make_inputs(name, world_size):
    """Full-sequence q, k, v, dout (float32).  The sharp input is local attention (conftest's
    local_inputs) plus an attention sink on key 0 (about half of each row's mass), so that tau = 1
    skips many tiles and both anchors' seeds change decisions (a schedule without either seed
    retains different tiles on this input)."""
    batch, hq, hkv, d, chunk, _, _, _, _, sharp = CASES[name]
    n = 2 * world_size * chunk
    if sharp:
        q, k, v = local_inputs("cpu", batch, n, hq, hkv, d, sharpness=4.0, seed=2)
        q[..., -1] = 4.0
        k[..., -1] = 0.0
        k[:, 0, :, -1] = 15.0
    else:
        g = torch.Generator().manual_seed(7)
        q = torch.randn(batch, n, hq, d, generator=g)
        k = torch.randn(batch, n, hkv, d, generator=g)
        v = torch.randn(batch, n, hkv, d, generator=g)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    return q, k, v, dout


def _worker(rank, world_size, folder):
    """One rank: every case through mala.distributed.attention, forward and backward; saves its shards."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size)
    try:
        for name, (_, _, _, _, _, tau, scale, fwd, bwd, _) in CASES.items():
            q, k, v, dout = (mcp.zigzag_shard(t, rank, world_size) for t in make_inputs(name, world_size))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out, lse, stats = mcp.attention(q, k, v, tau=tau, softmax_scale=scale, return_lse=True,
                                            return_stats=True, block_q=fwd[0], block_k=fwd[1], bwd_block_q=bwd[0],
                                            bwd_block_k=bwd[1])
            out.backward(dout)
            torch.save(dict(out=out.detach(), lse=lse, dq=q.grad, dk=k.grad, dv=v.grad, fwd_slots=stats.fwd_slots,
                            bwd_slots=stats.bwd_slots, stats=stats), os.path.join(folder, f"{name}.{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ring(request, tmp_path_factory):
    """Runs the ring once per world size; returns {case: full-sequence results} (shards unsharded)."""
    world_size = request.param
    folder = str(tmp_path_factory.mktemp(f"ring{world_size}"))
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # W processes share CI's 2 cores
    try:
        mp.spawn(_worker, args=(world_size, folder), nprocs=world_size, join=True)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    results = {}
    for name in CASES:
        shards = [torch.load(os.path.join(folder, f"{name}.{r}.pt"), weights_only=False) for r in range(world_size)]
        res = {key: mcp.zigzag_unshard([s[key] for s in shards], dim=2 if key in ("lse", "fwd_slots", "bwd_slots")
                                       else 1) for key in ("out", "lse", "dq", "dk", "dv", "fwd_slots", "bwd_slots")}
        res["stats"] = [s["stats"] for s in shards]
        results[name] = res
    return world_size, results


@functools.lru_cache(maxsize=None)
def _schedule_reference(name, world_size):
    batch, hq, hkv, d, chunk, tau, scale, fwd, bwd, _ = CASES[name]
    q, k, v, dout = make_inputs(name, world_size)
    return ref_schedule(q, k, v, dout, chunk, tau, scale, fwd, bwd), dense64(q, k, v, dout, scale)


def _max_err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def _assert_close(x, ref, name, rtol):
    """Max error relative to the reference's largest magnitude (fp32 results against fp64)."""
    err, scale = _max_err(x, ref), ref.double().abs().max().item()
    assert err <= rtol * max(scale, 1.0), f"{name}: max error {err:.3g} (reference max {scale:.3g})"


# ---- tests ----------------------------------------------------------------------------------------

def test_tau0_equals_dense(ring):
    """tau = 0: nothing is skipped; the ring is dense causal attention (fp32 against fp64)."""
    world_size, results = ring
    res = results["dense"]
    _, dense = _schedule_reference("dense", world_size)
    for key in ("out", "lse", "dq", "dk", "dv"):
        _assert_close(res[key], dense[key], key, 1e-5)
    # Every legal tile retained: per row, block_k x the legal key tiles of its query tile.
    _, _, _, _, chunk, _, _, (fq, fk), (bq, bk), _ = CASES["dense"]
    rows = torch.arange(2 * world_size * chunk)
    assert torch.equal(res["fwd_slots"][0, 0].long(), ((rows // fq * fq + fq - 1) // fk + 1) * fk)
    assert torch.equal(res["bwd_slots"][0, 0].long(), ((rows // bq * bq + bq - 1) // bk + 1) * bk)
    assert all(s.fwd_retained_fraction == 1.0 and s.bwd_retained_fraction == 1.0 for s in res["stats"])


def test_tau1_equals_schedule_reference(ring):
    """tau = 1 on a sharp input: the same tiles as the float64 reference of the split schedule (up to
    docs/spec.md's rounding flips: only where the reference's margin is below 1e-3), and the same
    outputs, lse and gradients."""
    world_size, results = ring
    res = results["sharp"]
    ref, _ = _schedule_reference("sharp", world_size)
    retained, legal = ref["fwd_tiles"]
    assert retained < 0.8 * legal, "the input must make tau = 1 skip tiles, or this test cannot fail"
    q, k, v, dout = make_inputs("sharp", world_size)
    _, _, _, _, chunk, tau, scale, fwd, bwd, _ = CASES["sharp"]
    per_split = ref_schedule(q, k, v, dout, chunk, tau, scale, fwd, bwd, seeded=False, backward=False)
    assert not torch.equal(per_split["fwd_slots"], ref["fwd_slots"]), "the input must make the seeds matter"
    fwd_diff = res["fwd_slots"].long() != ref["fwd_slots"]
    bwd_diff = res["bwd_slots"].long() != ref["bwd_slots"]
    assert not (fwd_diff & (ref["fwd_margin"] >= FLIP_MARGIN)).any(), "forward slots"
    assert not (bwd_diff & (ref["bwd_margin"] >= FLIP_MARGIN)).any(), "backward slots"
    if fwd_diff.any() or bwd_diff.any():
        pytest.skip("a rounding flip changed a tile: outputs not compared")  # not seen with this input
    for key in ("out", "lse", "dq", "dk", "dv"):
        _assert_close(res[key], ref[key], key, 1e-5)
    for s in res["stats"]:  # totals over all ranks
        assert (s.fwd_retained_tiles, s.fwd_legal_tiles) == tuple(ref["fwd_tiles"])
        assert (s.bwd_retained_tiles, s.bwd_legal_tiles) == tuple(ref["bwd_tiles"])
        assert s.mean_fwd_slots == pytest.approx(ref["fwd_slots"].double().mean().item())
        assert s.mean_bwd_slots == pytest.approx(ref["bwd_slots"].double().mean().item())


def test_tau1_omitted_mass_bound(ring):
    """The bound of docs/spec.md holds across the ranks: 1 - exp(lse - lse_dense) <= tau / (1 + tau)."""
    world_size, results = ring
    _, dense = _schedule_reference("sharp", world_size)
    omitted = 1 - torch.exp(results["sharp"]["lse"].double() - dense["lse"])
    assert omitted.max().item() <= 0.5 + 1e-6
    assert omitted.max().item() > 1e-3  # something was omitted


def test_schedule_reference_one_split_equals_library():
    """The schedule reference with one split (chunk = N) is the plain rule: it equals the library's
    single call (torch.ops.mala.fwd / bwd on the CPU, default tiles 128 x 128): slots bit for bit,
    outputs and gradients to fp32 rounding.  This checks the reference itself."""
    q, k, v = local_inputs("cpu", 1, 1024, 4, 2, 32, sharpness=4.0, seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    ref = ref_schedule(q, k, v, dout, 1024, 1.0, None, (128, 128), (128, 128))
    out, lse, slots, mask = torch.ops.mala.fwd(q, k, v, 1.0, True, 0.0, True)
    dq, dk, dv, bwd_slots, _ = torch.ops.mala.bwd(dout, q, k, v, out, lse, 1.0, True, 0.0, True)
    assert (mask == RETAINED).sum() < 0.8 * (mask != ILLEGAL).sum(), "tiles must be skipped"
    assert ref["fwd_margin"].min() > FLIP_MARGIN and ref["bwd_margin"].min() > FLIP_MARGIN
    assert torch.equal(slots.long(), ref["fwd_slots"])
    assert torch.equal(bwd_slots.long(), ref["bwd_slots"])
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        _assert_close(x, ref[name], name, 1e-5)


@pytest.mark.parametrize("causal, seeded, owns_tile0, owns_newest, rows_before", [
    (True, False, False, False, -1),    # the plain forward rule
    (True, True, False, True, 128),     # a diagonal pair of a later chunk
    (False, True, True, False, 128),    # the pair holding key tile 0
    (False, True, False, False, 128),   # a far pair
])
def test_split_operators_match_reference(causal, seeded, owns_tile0, owns_newest, rows_before):
    """torch.ops.mala.fwd_split / bwd_split against their float64 reference, one call each, with an
    arbitrary seed (not an anchor mass): tile masks and slots exactly (the reference's margins are
    checked to be clear of rounding), out, lse and gradients to fp32 rounding."""
    q, k, v = local_inputs("cpu", 1, 64, 4, 2, 16, sharpness=4.0, seed=5)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(q.shape, generator=g)
    seed = (torch.rand(1, 4, 64, generator=g) * 4 + 1) if seeded else None
    block_q, block_k = 16, 16
    out, lse, slots, mask = torch.ops.mala.fwd_split(q, k, v, seed, rows_before, owns_tile0, owns_newest, 1.0, causal,
                                                     0.0, block_q, block_k, True)
    ref_out, ref_lse, kept, ref_mask, margin = ref_fwd_split64(q, k, v, seed, rows_before, owns_tile0, owns_newest,
                                                               1.0, causal, 0.25, block_q, block_k)
    assert margin.min() > FLIP_MARGIN
    assert (ref_mask == SKIPPED).any(), "the input must make tiles skipped"
    assert torch.equal(mask, ref_mask)
    assert torch.equal(slots.long(), _row_slots(kept, block_q, block_k, 64, 64, causal))
    _assert_close(out, ref_out, "out", 1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    _assert_close(lse[finite], ref_lse[finite], "lse", 1e-5)
    # The backward with this call's out and lse as if they were final (the contract allows any).
    if not bool(finite.all()):
        return  # a row that retained nothing has no lse to test against
    dq, dk, dv, bwd_slots, bwd_mask = torch.ops.mala.bwd_split(dout, q, k, v, out, lse, rows_before, 1.0, causal,
                                                               0.0, block_q, block_k, True, False)
    ref = ref_bwd_split64(dout, q, k, v, out, lse, rows_before, 1.0, causal, 0.25, block_q, block_k)
    assert ref[5].min() > FLIP_MARGIN
    assert torch.equal(bwd_mask, ref[4])
    assert torch.equal(bwd_slots.long(), _row_slots(ref[3], block_q, block_k, 64, 64, causal))
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[:3]):
        _assert_close(x, r, name, 1e-5)


@pytest.mark.parametrize("world_size", [1, 3])
def test_single_process_simulation(world_size):
    """The benchmark's single-process schedule (_LocalComm: all ranks in lockstep, no communication)
    with one rank and with an odd world size, against the schedule reference."""
    q, k, v, dout = make_inputs("sharp", world_size)
    _, _, _, _, chunk, tau, scale, fwd, bwd, _ = CASES["sharp"]
    ref = ref_schedule(q, k, v, dout, chunk, tau, scale, fwd, bwd)
    plan = mcp._make_plan(q[:, :2 * chunk], k[:, :2 * chunk], tau, scale, fwd + bwd, True, False)
    comm = mcp._LocalComm(world_size)
    qs, ks, vs, ds = ([mcp.zigzag_shard(t, r, world_size) for r in range(world_size)] for t in (q, k, v, dout))
    outs, lses, work = mcp._forward(comm, plan, qs, ks, vs)
    dqs, dks, dvs, _ = mcp._backward(comm, plan, qs, ks, vs, outs, lses, ds)
    fwd_slots = mcp.zigzag_unshard([torch.cat(w.slots, dim=2) for w in work], dim=2)
    assert torch.equal(fwd_slots.long(), ref["fwd_slots"])
    for name, xs, dim in (("out", outs, 1), ("lse", lses, 2), ("dq", dqs, 1), ("dk", dks, 1), ("dv", dvs, 1)):
        _assert_close(mcp.zigzag_unshard(xs, dim=dim), ref[name], name, 1e-5)


def test_zigzag_roundtrip():
    x = torch.arange(2 * 3 * 2 * 4).view(2, 24, 1, 1).float()
    shards = [mcp.zigzag_shard(x, r, 3) for r in range(3)]
    assert shards[0][0, :, 0, 0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(mcp.zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="^x: "):
        mcp.zigzag_shard(x, 0, 5)


def _shard(n=64, hq=4, hkv=2, d=16):
    return torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)


@pytest.mark.parametrize("kwargs, shapes, argument", [
    (dict(causal=False), {}, "causal"),
    (dict(block_q=16, block_k=16), dict(n=40), "block_q"),          # C = 20
    (dict(block_q=8, block_k=16), dict(n=48), "block_k"),           # C = 24
    (dict(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=64), {}, "bwd_block_k"),
    ({}, {}, "block_q"),                                            # C = 32 < the CPU's 128 tiles
    (dict(block_q=16, block_k=16), dict(n=33), "q"),               # odd shard
    (dict(tau=-1.0, block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16), {}, "tau"),
    (dict(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16), {}, "group"),  # not initialized
])
def test_errors_name_the_argument(kwargs, shapes, argument):
    q, k, v = _shard(**shapes)
    with pytest.raises(ValueError, match=f"^{argument}: "):
        mcp.attention(q, k, v, **kwargs)


@pytest.mark.parametrize("which, argument", [("k_tokens", "k"), ("v_shape", "v"), ("heads", "k"), ("dim", "k")])
def test_shape_mismatch_names_the_argument(which, argument):
    q, k, v = _shard()
    if which == "k_tokens":
        k, v = k[:, :32], v[:, :32]
    elif which == "v_shape":
        v = v[:, :, :1]
    elif which == "heads":
        k, v = torch.randn(1, 64, 3, 16), torch.randn(1, 64, 3, 16)
    else:
        k, v = torch.randn(1, 64, 2, 8), torch.randn(1, 64, 2, 8)
    with pytest.raises(ValueError, match=f"^{argument}: "):
        mcp.attention(q, k, v, block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_cuda_ring_matches_one_call(tau):
    """On the GPU (bf16 kernels, their own tiles), the whole ring in one process (_LocalComm, W = 2)
    against mala.attention on the full sequence: outputs and gradients to bf16 rounding, the omitted
    mass within the bound, and the realized work (tau = 0: the single call's; tau = 1: the ring skips,
    and the backward's decisions are the single call's up to rounding flips)."""
    world, n = 2, 2048
    q, k, v = local_inputs("cuda", 1, n, 4, 1, 128, sharpness=4.0, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse, stats = mala.attention(qf, kf, vf, tau=tau, return_lse=True, return_stats=True)
    out.backward(dout)
    _, lse_dense, dense_stats = mala.attention(q.detach(), k.detach(), v.detach(), tau=0.0, return_lse=True,
                                               return_stats=True)
    plan = mcp._make_plan(q[:, :n // world], k[:, :n // world], tau, None, (0, 0, 0, 0), True, False)
    comm = mcp._LocalComm(world)
    qs, ks, vs, ds = ([mcp.zigzag_shard(t.detach(), r, world).contiguous() for r in range(world)]
                      for t in (q, k, v, dout))
    outs, lses, fwd_work = mcp._forward(comm, plan, qs, ks, vs)
    dqs, dks, dvs, bwd_work = mcp._backward(comm, plan, qs, ks, vs, outs, lses, ds)
    unshard = lambda xs, dim=1: mcp.zigzag_unshard(xs, dim=dim)  # noqa: E731
    rel = lambda x, r: ((x.float() - r.float()).norm() / r.float().norm()).item()  # noqa: E731
    assert rel(unshard(outs), out) < 1e-2
    # Each pair's gradients are rounded to bf16 before the fp32 sums (dq: 1.3e-2 on the CPU's bf16 path).
    for name, xs, ref in (("dq", dqs, qf.grad), ("dk", dks, kf.grad), ("dv", dvs, vf.grad)):
        assert rel(unshard(xs), ref) < 3e-2, name
    ring_lse = unshard(lses, 2)
    assert (1 - torch.exp(ring_lse - lse_dense)).max().item() <= tau / (1 + tau) + 1e-3
    fwd_slots, bwd_slots = mcp._reduce_work(comm, fwd_work)[0], mcp._reduce_work(comm, bwd_work)[0]
    if tau == 0:
        assert fwd_slots == pytest.approx(stats.mean_fwd_slots) and bwd_slots == pytest.approx(stats.mean_bwd_slots)
    else:
        # The ring skips (its 4 short splits keep more than one call does at this length: 572 against
        # 436 slots on the CPU's 128-key tiles); the backward tests against the ring's lse, which
        # differs from the call's only by what each retained.
        assert fwd_slots < dense_stats.mean_fwd_slots and stats.mean_fwd_slots < dense_stats.mean_fwd_slots
        assert bwd_slots == pytest.approx(stats.mean_bwd_slots, rel=0.05)


def test_split_operators_fake_shapes():
    """The split operators' fake implementations (torch.compile, FakeTensor) give the real shapes,
    with the caller's tiles or the implementation's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16)
    real = torch.ops.mala.fwd_split(q, k, k, None, 64, False, False, 1.0, True, 0.0, 16, 32, True)
    real_b = torch.ops.mala.bwd_split(q, q, k, k, real[0], real[1], 64, 1.0, True, 0.0, 16, 32, True, False)
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        fake = torch.ops.mala.fwd_split(fq, fk, fk, None, 64, False, False, 1.0, True, 0.0, 16, 32, True)
        fake_b = torch.ops.mala.bwd_split(fq, fq, fk, fk, fake[0], fake[1], 64, 1.0, True, 0.0, 16, 32, True, False)
        plain = torch.ops.mala.fwd_split(fq, fk, fk, None, 64, False, False, 1.0, True, 0.0, 0, 0, False)
    assert [t.shape for t in fake] == [t.shape for t in real]
    assert [t.shape for t in fake_b] == [t.shape for t in real_b]
    assert plain[2].numel() == 0 and plain[3].numel() == 0

"""CPU tests of the study's attention methods (lab/ar/ar_methods.py): each fixed-budget baseline's
selected support against a brute-force reference from the same scores, its slots against the
ceiling, its output against softmax over that support, and chunking/checkpointing invariance."""

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ar_methods as M  # noqa: E402
import dense_masked  # noqa: E402
from ar_model import rope  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, create_mask  # noqa: E402

B, N, H, D = 2, 37, 2, 8
CFG = M.MethodConfig(ceiling=8, moba_block=4, dsa_heads=4, dsa_dim=4)


def qkv(seed=0, n=N, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(B, n, H, D, generator=g, dtype=torch.float64).float() for _ in range(3)]
    return [x.requires_grad_(requires_grad) for x in t]


def ref_swa(n, W):
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(max(0, i - W + 1), i + 1):
            m[i, j] = True
    return m


def ref_moba(q, k, blk, topk):
    Bq, n, Hq, d = q.shape
    nb = -(-n // blk)
    m = torch.zeros(Bq, Hq, n, n, dtype=torch.bool)
    for b in range(Bq):
        for h in range(Hq):
            means = [k[b, s * blk:min(n, (s + 1) * blk), h].double().mean(0) for s in range(nb)]
            for i in range(n):
                cur = i // blk
                past = sorted(((float(q[b, i, h].double() @ means[s]), s) for s in range(cur)), reverse=True)
                chosen = {cur} | {s for _, s in past[:topk - 1]}
                for j in range(i + 1):
                    m[b, h, i, j] = (j // blk) in chosen
    return m


def ref_dsa_scores(qi, ki, wi):
    Bq, n, HI, _ = qi.shape
    s = torch.zeros(Bq, n, n, dtype=torch.float64)
    for b in range(Bq):
        for i in range(n):
            for j in range(n):
                s[b, i, j] = sum(float(wi[b, i, h]) * max(0.0, float(qi[b, i, h].double() @ ki[b, j].double()))
                                 for h in range(HI))
    return s


def ref_topk(scores, K):
    """The top-K past keys of each row, and whether the row's choice is ambiguous (a tie at the
    K-th score: relu makes exact zeros common, and any of the tied keys is then correct)."""
    Bq, n, _ = scores.shape
    m = torch.zeros(Bq, n, n, dtype=torch.bool)
    tie = torch.zeros(Bq, n, dtype=torch.bool)
    for b in range(Bq):
        for i in range(n):
            order = sorted(range(i + 1), key=lambda j: -float(scores[b, i, j]))
            m[b, i, order[:K]] = True
            tie[b, i] = i + 1 > K and float(scores[b, i, order[K - 1]]) == float(scores[b, i, order[K]])
    return m, tie


def dense_ref(q, k, v, allow):
    """float64 softmax over the allowed keys; allow broadcastable to [B, H, N, N]."""
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~allow, float("-inf")), -1)
    return torch.einsum("bhij,bjhd->bihd", p, v.double())


def tiles(bm):
    """(partial, full) boolean tile maps [B, H, nq, nk] of a BlockMask, whatever its index order."""
    def dense(num, idx):
        nk = idx.shape[-1]
        keep = torch.arange(nk)[None, None, None, :] < num[..., None].long()
        out = torch.zeros(*idx.shape[:-1], nk + 1, dtype=torch.bool)
        return out.scatter_(-1, torch.where(keep, idx.long(), nk), True)[..., :nk]
    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else None
    return dense(bm.kv_num_blocks, bm.kv_indices), full


def assert_same_tiles(ours, mod, Bm, Hm, n, tile):
    """Our BlockMask lists the tiles that torch's create_block_mask builds from the same mask_mod."""
    ref = create_block_mask(mod, Bm, Hm, n, n, device="cpu", BLOCK_SIZE=tile)
    (p, f), (rp, rf) = tiles(ours), tiles(ref)
    assert torch.equal(p, rp.expand_as(p)) and torch.equal(f, rf.expand_as(f))
    assert ours.seq_lengths == (n, n)
    return p, f


def test_swa_support():
    W = CFG.ceiling
    got = create_mask(M.swa_mask_mod(W), 1, 1, N, N, "cpu")[0, 0]
    assert torch.equal(got, ref_swa(N, W))
    assert got.sum(-1).max() <= W
    assert M.swa_mean_slots(N, W) == pytest.approx(float(got.sum()) / N)


def test_moba_support():
    q, k, _ = qkv(1)
    blk, topk = CFG.moba_block, CFG.moba_topk
    sel = M.moba_select(q, k, blk, topk)
    assert sel.shape == (B, H, N, -(-N // blk))
    got = create_mask(M.moba_mask_mod(sel, blk), B, H, N, N, "cpu")
    assert torch.equal(got, ref_moba(q, k, blk, topk))
    assert got.sum(-1).max() <= CFG.ceiling
    assert float(M.moba_slots(sel, blk)) == pytest.approx(float(got.sum()) / (B * H * N))
    # Routing matters here: some row leaves out a past block it could have seen.
    assert (got.sum(-1) < M.causal_allow(0, N, N, "cpu").sum(-1)).any()


def _dsa_inputs(seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, 4, 4, generator=g), torch.randn(B, N, 4, generator=g), torch.randn(B, N, 4, generator=g)


@pytest.mark.parametrize("r0,r1", [(0, N), (9, 31)])
def test_dsa_support(r0, r1):
    qi, ki, wi = _dsa_inputs()
    scores = M.dsa_index_scores(qi[:, r0:r1], ki, wi[:, r0:r1])
    ref = ref_dsa_scores(qi, ki, wi)
    assert torch.allclose(scores.double(), ref[:, r0:r1], atol=1e-4)
    idx, valid = M.dsa_topk(scores, r0, CFG.ceiling)
    words = M.dsa_pack(idx, valid, -(-N // 32))
    # The chunk's rows are the bitsets' rows: row i of the mask is row r0 + i of the sequence.
    got = create_mask(M.dsa_mask_mod(words), B, 1, r1 - r0, N, "cpu")[:, 0]
    assert torch.equal(got.sum(-1), valid.sum(-1))  # every valid pick, and only those, is allowed
    want, tie = ref_topk(ref, CFG.ceiling)
    want, tie, ref = want[:, r0:r1], tie[:, r0:r1], ref[:, r0:r1]
    assert (~tie).float().mean() > 0.5  # most rows have one right answer
    assert torch.equal(got[~tie], want[~tie])
    for b, i in tie.nonzero().tolist():  # a tied row: every chosen key scores at least every other
        row = ref[b, i, :r0 + i + 1]
        assert row[got[b, i, :r0 + i + 1]].min() >= row[~got[b, i, :r0 + i + 1]].max()
    counts = got.sum(-1)
    rows = torch.arange(r0, r1)
    assert torch.equal(counts, torch.clamp(rows + 1, max=CFG.ceiling).expand_as(counts))
    assert not (got & ~M.causal_allow(r0, r1, N, "cpu")).any()


def test_dsa_pack_uses_every_bit():
    # Keys 31 and 63 set the words' sign bits: two's complement, read back by the mask_mod.
    n = 64
    idx = torch.tensor([[[0, 31, 32, 63], [5, 6, 62, 63]]])
    valid = torch.tensor([[[True, True, True, True], [True, False, True, True]]])
    words = M.dsa_pack(idx, valid, 2)
    assert words.dtype == torch.int32 and int(words[0, 0, 0]) == 1 - 2 ** 31 and int(words[0, 0, 1]) == 1 - 2 ** 31
    got = create_mask(M.dsa_mask_mod(words), 1, 1, 2, n, "cpu")[0, 0]
    assert got[0].nonzero().flatten().tolist() == [0, 31, 32, 63]
    assert got[1].nonzero().flatten().tolist() == [5, 62, 63]


@pytest.mark.parametrize("n,tile", [(N, 8), (40, 4), (64, 16)])
def test_swa_block_mask(n, tile):
    W = 8
    p, f = assert_same_tiles(M.swa_block_mask(n, W, torch.device("cpu"), tile), M.swa_mask_mod(W), None, None, n, tile)
    if n == 64:  # window 8 in tiles of 16: the diagonal tiles and the ones just below, no full tile
        assert int(p.sum()) == 2 * (n // tile) - 1 and not f.any()


@pytest.mark.parametrize("n,blk,tile", [(N, 4, 8), (40, 8, 4), (40, 4, 4), (48, 6, 4), (64, 4, 16), (N, 4, 2),
                                         (512, 64, M.TILE)])
def test_moba_block_mask(n, blk, tile):
    q, k, _ = qkv(8, n=n)
    sel = M.moba_select(q, k, blk, 3 if n < 512 else 2)
    mod = M.moba_mask_mod(sel, blk, tile)
    bm = M.block_mask_from_counts(M.moba_tile_counts(sel, blk, tile), n, tile, mod)
    p, f = assert_same_tiles(bm, mod, B, H, n, tile)
    if n == 40 and blk == 4:
        assert f.any() and p.any()  # both kinds of tile are exercised


@pytest.mark.parametrize("n,tile,chunk", [(N, 8, 5), (64, 4, 64), (64, 16, 7), (N, 2, 9), (512, M.TILE, 100)])
def test_dsa_block_mask(n, tile, chunk):
    g = torch.Generator().manual_seed(9)
    qi, ki, wi = (torch.randn(B, n, *s, generator=g) for s in ((4, 4), (4,), (4,)))
    npad = M.padded(n, tile)
    words = torch.zeros(B, npad, -(-npad // 32), dtype=torch.int32)
    counts = torch.zeros(B, 1, npad // tile, npad // tile, dtype=torch.int32)
    for r0 in range(0, n, chunk):
        idx, valid = M.dsa_topk(M.dsa_index_scores(qi[:, r0:r0 + chunk], ki, wi[:, r0:r0 + chunk]), r0, 12)
        words[:, r0:r0 + idx.shape[1]] = M.dsa_pack(idx, valid, words.shape[-1])
        M.dsa_add_tile_counts(counts, idx, valid, r0, tile)
    mod = M.dsa_mask_mod(words)
    p, f = assert_same_tiles(M.block_mask_from_counts(counts, n, tile, mod), mod, B, 1, n, tile)
    if tile == 4:
        assert f.any()  # the first rows take every past key: full tiles


def _module(method, cfg=CFG, chunk=5, seed=0):
    torch.manual_seed(seed)
    m = M.Attention(method, H * D, H, D, cfg)
    m.chunk = chunk
    return m


def _x(seed=3):
    return torch.randn(B, N, H * D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["swa", "moba", "dsa"])
def test_baseline_output_slots_and_chunking(method):
    q, k, v = qkv(4, requires_grad=True)
    x = _x()
    m = _module(method)
    out = m(q, k, v, x, rope)
    rows = torch.ones(B, N, dtype=torch.bool)  # rows whose reference support is unambiguous
    if method == "swa":
        allow = ref_swa(N, CFG.ceiling)
    elif method == "moba":
        allow = ref_moba(q.detach(), k.detach(), CFG.moba_block, CFG.moba_topk)
    else:
        xd = x
        qi = rope(m.iq(xd).view(B, N, 4, 4)) * 4 ** -0.5
        ki = rope(m.ik(xd).view(B, N, 1, 4))[:, :, 0]
        wi = m.iw(xd) * 4 ** -0.5
        allow, tie = ref_topk(ref_dsa_scores(qi.detach(), ki.detach(), wi.detach()), CFG.ceiling)
        allow, rows = allow[:, None], ~tie
        assert rows.float().mean() > 0.5
    assert torch.allclose(out.double()[rows], dense_ref(q, k, v, allow)[rows], atol=1e-5)
    full_allow = allow.expand(B, H, N, N)  # ties change which keys, not how many
    assert float(m.last_slots) == pytest.approx(float(full_allow.sum()) / (B * H * N))
    assert float(m.last_slots) <= CFG.ceiling
    assert float(m.last_slots) < (N + 1) / 2  # the ceiling binds at this length
    # dsa's checkpointed chunks of 5 rows give the gradients of one unchunked pass.
    loss = out.square().sum() + (m.aux if m.aux is not None else 0.0)
    gq = torch.autograd.grad(loss, (q, k, v), retain_graph=False)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    m.chunk = N
    out2 = m(q2, k2, v2, x, rope)
    loss2 = out2.square().sum() + (m.aux if m.aux is not None else 0.0)
    g2 = torch.autograd.grad(loss2, (q2, k2, v2))
    assert torch.allclose(out, out2, atol=1e-6)
    for a, b in zip(gq, g2):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
@pytest.mark.parametrize("method", ["swa", "moba", "dsa"])
def test_flex_path_matches_the_old_dense_masked_path(method):
    q, k, v = qkv(10, requires_grad=True)
    x = _x(11)
    m = _module(method)
    # Forward through flex_attention (eager on the CPU: forward only) ...
    m.impl = "flex"
    with torch.no_grad():
        out_flex = m(q.detach(), k.detach(), v.detach(), x, rope)
        slots_flex, aux_flex = float(m.last_slots), m.aux
    old_out, old_slots, old_aux = dense_masked.forward(m, q, k, v, x, rope)
    assert torch.allclose(out_flex, old_out, atol=1e-5)
    assert slots_flex == pytest.approx(float(old_slots))
    if method == "dsa":
        assert float(aux_flex) == pytest.approx(float(old_aux.detach()), rel=1e-5)
    # ... and forward and backward through the CPU's dense path, indexer gradients included.
    m.impl = None
    out = m(q, k, v, x, rope)
    params = [p for p in m.parameters()]
    loss, old_loss = (o.square().sum() + (a if a is not None else 0.0) for o, a in ((out, m.aux), (old_out, old_aux)))
    got = torch.autograd.grad(loss, [q, k, v] + params)
    want = torch.autograd.grad(old_loss, [q, k, v] + params)
    assert torch.allclose(out, old_out, atol=1e-5)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_dsa_indexer_learns_from_kl_only():
    q, k, v = qkv(5, requires_grad=True)
    x = _x().requires_grad_(True)
    m = _module("dsa")
    out = m(q, k, v, x, rope)
    assert m.aux is not None and float(m.aux.detach()) > 0
    out.sum().backward(retain_graph=True)
    assert all(p.grad is None for p in (m.iq.weight, m.ik.weight, m.iw.weight))
    m.aux.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (m.iq.weight, m.ik.weight, m.iw.weight))
    assert x.grad is None  # the indexer's input is detached


@pytest.mark.parametrize("method", ["swa", "moba", "dsa"])
def test_wide_ceiling_is_full_attention(method):
    cfg = M.MethodConfig(ceiling=64, moba_block=8, dsa_heads=2, dsa_dim=4)
    q, k, v = qkv(6)
    out = _module(method, cfg)(q, k, v, _x(), rope)
    full = _module("full", cfg)(q, k, v, _x(), rope)
    assert torch.allclose(out, full, atol=1e-5)


def test_mala_on_cpu():
    pytest.importorskip("mala")
    q, k, v = qkv(7, n=64, requires_grad=True)
    full = _module("full")
    ref = full(q, k, v, None, rope)
    exact = _module("mala", M.MethodConfig(tau=0.0))
    out = exact(q, k, v, None, rope)
    assert torch.allclose(out, ref, atol=1e-5)
    # mala counts block_k slots per retained tile (its stats' unit), so tau = 0 retains every
    # legal tile: at least the visible keys.
    dense_slots = float(exact.last_slots)
    assert dense_slots >= float(full.last_slots)
    m = _module("mala")
    out = m(q, k, v, None, rope)
    out.sum().backward()
    assert q.grad is not None and 0 < float(m.last_slots) <= dense_slots
    assert m.last_stats.mean_bwd_slots is not None


def test_nsa_skips_with_a_reason_on_cpu():
    ok, why = M.available("nsa", "cpu")
    assert not ok and "CUDA" in why
    assert M.available("swa", "cpu") == (True, "")
    assert not M.available("flash", "cpu")[0]


def test_nominal_budgets():
    c = M.MethodConfig()
    assert c.moba_topk * c.moba_block == c.ceiling == 1024
    assert c.nsa_blocks * c.nsa_block + c.nsa_window <= c.ceiling
    assert M.nsa_nominal_slots(8192, c) <= c.ceiling
    with pytest.raises(ValueError):
        M.MethodConfig(ceiling=1000, moba_block=128).moba_topk


def test_nsa_wiring_with_a_stand_in_kernel(monkeypatch):
    # parallel_nsa needs Triton on a GPU; a stand-in with its signature checks the rest on the CPU:
    # heads to KV heads of NSA_GROUP queries, the gates' split, and the sliding term added here.
    calls = []

    def stand_in(q, k, v, g_cmp, g_slc, g_swa, block_counts, block_size, window_size):
        calls.append((q.shape, k.shape, g_cmp.shape, g_swa, window_size, block_counts, block_size))
        G = q.shape[2] // k.shape[2]
        kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)  # any per-head function will do
        o_slc = dense_ref(q, kk, vv, M.causal_allow(0, q.shape[1], q.shape[1], "cpu")).to(q.dtype)
        running_mean = vv.cumsum(1) / torch.arange(1, q.shape[1] + 1)[None, :, None, None]
        return o_slc * g_slc.unsqueeze(-1) + running_mean * g_cmp.unsqueeze(-1)

    monkeypatch.setattr(M, "_parallel_nsa", lambda: stand_in)
    cfg = M.MethodConfig(ceiling=16, nsa_block=4, nsa_window=8)
    q, k, v = (t.to(torch.bfloat16) for t in qkv(12))
    x = _x(13)
    m = _module("nsa", cfg)
    out = m(q, k, v, x, rope)
    G = M.NSA_GROUP
    assert calls == [((B, N, H * G, D), (B, N, H, D), (B, N, H * G), None, 0, cfg.nsa_blocks, cfg.nsa_block)]
    g_cmp, g_slc, g_swa = torch.sigmoid(m.gate(x)).to(torch.bfloat16).split(H, dim=-1)
    base = stand_in(q.repeat_interleave(G, 2), k, v, g_cmp.repeat_interleave(G, 2), g_slc.repeat_interleave(G, 2),
                    None, 0, 0, 0)[:, :, ::G]
    want = base.double() + g_swa.double()[..., None] * dense_ref(q, k, v, ref_swa(N, cfg.nsa_window))
    assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), want, atol=2e-2, rtol=1e-2)
    assert float(m.last_slots) == pytest.approx(M.nsa_nominal_slots(N, cfg))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention: CUDA only")
@pytest.mark.parametrize("method", ["swa", "moba", "dsa"])
def test_flex_matches_dense_on_gpu(method):
    # 1,024 rows in tiles of 128 and a ceiling of 256: skipped, partial and full tiles all occur.
    cfg = M.MethodConfig(ceiling=256, moba_block=64, dsa_heads=4, dsa_dim=32)
    Bg, n, Hg, d = 2, 1024, 2, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, w = (torch.randn(Bg, n, Hg, d, device="cuda", generator=g) for _ in range(4))
    x = torch.randn(Bg, n, Hg * d, device="cuda", generator=g)
    torch.manual_seed(0)
    m = M.Attention(method, Hg * d, Hg, d, cfg).cuda()
    res = {}
    for impl in ("flex", "dense"):
        m.impl = impl
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = m(qq, kk, vv, x, rope)
        loss = (out * w).sum() + (m.aux if m.aux is not None else 0.0)
        res[impl] = (out.detach(), float(m.last_slots), torch.autograd.grad(loss, (qq, kk, vv)))
    (o1, s1, g1), (o2, s2, g2) = res["flex"], res["dense"]
    assert s1 == pytest.approx(s2) and s1 < (n + 1) / 2
    assert torch.allclose(o1, o2, atol=2e-3, rtol=2e-3)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=5e-3, rtol=5e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="parallel_nsa is a Triton kernel: CUDA only")
def test_nsa_matches_its_naive_reference_on_gpu():
    fla_nsa = pytest.importorskip("fla.ops.nsa")
    g = torch.Generator(device="cuda").manual_seed(0)
    Bg, T, Hkv, G, d = 1, 256, 1, 16, 64
    q = torch.randn(Bg, T, Hkv * G, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(Bg, T, Hkv, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    g_cmp, g_slc = (torch.rand(Bg, T, Hkv * G, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    # Window 0 in both: fla-core 0.6.0 computes its sliding branch with flash-attn, absent here.
    kw = dict(block_counts=2, block_size=32, window_size=0)
    out = fla_nsa.parallel_nsa(q, k, v, g_cmp, g_slc, None, **kw)
    ref = fla_nsa.naive_nsa(q, k, v, g_cmp, g_slc, None, **kw)
    assert (out.float() - ref.float()).abs().max() < 5e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="parallel_nsa is a Triton kernel: CUDA only")
def test_nsa_module_is_flas_gated_sum_on_gpu():
    fla_nsa = pytest.importorskip("fla.ops.nsa")
    cfg = M.MethodConfig(ceiling=96, nsa_block=32, nsa_window=32)  # 2 selected blocks of 32 + 32 keys
    Bg, T, Hg, d, G = 2, 256, 2, 64, M.NSA_GROUP
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(Bg, T, Hg, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    x = torch.randn(Bg, T, Hg * d, device="cuda", generator=g)
    torch.manual_seed(0)
    m = M.Attention("nsa", Hg * d, Hg, d, cfg).cuda()
    with torch.no_grad():
        out = m(q, k, v, x, rope)
        gates = torch.sigmoid(m.gate(x)).to(torch.bfloat16)
        g_cmp, g_slc, g_swa = (gates[..., i * Hg:(i + 1) * Hg].repeat_interleave(G, 2) for i in range(3))
        qg = q.repeat_interleave(G, 2)
        # fla's parallel_nsa / naive_nsa with window_size W add torch.addcmul(o, o_swa, g_swa), o_swa =
        # flash_attn_func(q, k, v, causal=True, window_size=(W - 1, 0)): the last W keys, scale
        # 1 / sqrt(d), query head h on KV head h // G.  Here o_swa is that, in float64.
        o_swa = dense_ref(qg, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2), ref_swa(T, cfg.nsa_window).cuda())
        kw = dict(block_counts=cfg.nsa_blocks, block_size=cfg.nsa_block, window_size=0)
        for nsa in (fla_nsa.parallel_nsa, fla_nsa.naive_nsa):
            ref = nsa(qg, k, v, g_cmp, g_slc, None, **kw).double() + g_swa.double()[..., None] * o_swa
            ref = ref.view(Bg, T, Hg, G, d)
            assert (ref - ref[:, :, :, :1]).abs().max() < 1e-2  # the group's copies agree
            assert (out.double() - ref[:, :, :, 0]).abs().max() < 5e-2

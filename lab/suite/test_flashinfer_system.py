"""CPU tests of the FlashInfer skip-softmax adapter (no GPU, no flashinfer needed):
    python3 -m pytest -q lab/suite/test_flashinfer_system.py"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fi_system as F  # noqa: E402
import systems as S  # noqa: E402
import skip_softmax as SK  # noqa: E402


def test_ragged_layout_roundtrip():
    B, N, Hq, Hkv, d = 2, 5, 4, 2, 8
    q, k, v = torch.randn(B, N, Hq, d), torch.randn(B, N, Hkv, d), torch.randn(B, N, Hkv, d)
    qr, kv = F.to_ragged(q, k, v)
    assert qr.shape == (B * N, Hq, d) and kv.shape == (B * N, 2, Hkv, d)
    assert qr.is_contiguous() and kv.is_contiguous()
    # token t of sequence b is row b * N + t; kv[:, 0] is K, kv[:, 1] is V
    assert torch.equal(qr[1 * N + 3], q[1, 3])
    assert torch.equal(kv[1 * N + 2, 0], k[1, 2]) and torch.equal(kv[1 * N + 2, 1], v[1, 2])
    assert torch.equal(F.from_ragged(qr, B, N), q)
    with pytest.raises(ValueError):
        F.to_ragged(q, torch.randn(B, N, 3, d), torch.randn(B, N, 3, d))  # Hq % Hkv != 0


def test_cu_seqlens():
    seq, cu = F.cu_seqlens(3, 8192)
    assert seq.dtype == torch.int32 and cu.dtype == torch.int32
    assert seq.tolist() == [8192] * 3 and cu.tolist() == [0, 8192, 16384, 24576]


def test_threshold_and_knob_mapping():
    assert F.threshold(0.0, 8192) == 0.0
    assert F.threshold(4.0, 8192) == pytest.approx(4.0 / 8192)
    # last row (L_q = N) with a retained sum l = 1: the two thresholds coincide at sf = tau
    assert F.sf_for_tau(4.0, 8192, 8192, 1.0) == pytest.approx(4.0)
    # earlier rows and larger normalizers make MALA's test looser than BLASST's at sf = tau
    assert F.sf_for_tau(1.0, 8192, 1024, 10.0) == pytest.approx(80.0)
    assert F.omitted_bound(1.0, 8192, 8192) == pytest.approx(0.5)
    assert F.omitted_bound(1.0, 4096, 8192) == pytest.approx(1 / 3)


def test_lse_from_stats():
    B, N, H, d = 1, 6, 3, 16
    s = torch.randn(B * N, H, N) * 4        # raw (unscaled) scores per token, head, key
    scale = 1 / math.sqrt(d)
    mx = s.amax(-1)
    stats = torch.stack((mx / math.sqrt(d), torch.exp(scale * (s - mx[..., None])).sum(-1)), -1)
    lse = F.lse_from_stats(stats, B, N, scale, d)
    ref = torch.logsumexp(scale * s, -1).view(B, N, H).permute(0, 2, 1)
    assert lse.shape == (B, H, N)
    torch.testing.assert_close(lse, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        F.lse_from_stats(stats, B, N, 0.5, d)


def _naive_blasst(q, k, sf, sq, skv):
    """Loop transcription of the kernel rule: one head, causal, key steps from 0 upward."""
    N, d = q.shape
    sc = 1 / math.sqrt(d)
    lam = sf / N
    s = (q.double() @ k.double().T)
    kept = legal = 0
    for i in range(N // sq):
        rows = range(i * sq, (i + 1) * sq)
        run = [-math.inf] * sq
        for j in range((N + skv - 1) // skv):
            cols = range(j * skv, min(N, (j + 1) * skv))
            bm = [max((float(s[r, c]) for c in cols if c <= r), default=-math.inf) for r in rows]
            if all(b == -math.inf for b in bm):
                continue
            legal += 1
            skip = j > 0 and all(b == -math.inf or math.exp(sc * (b - m)) < lam for b, m in zip(bm, run))
            kept += not skip
            run = [max(m, b) for m, b in zip(run, bm)]
    return kept / legal


@pytest.mark.parametrize("sf", [0.0, 1.0, 64.0])
def test_blasst_rule_matches_loop(sf):
    torch.manual_seed(0)
    N, d = 64, 16
    q = torch.randn(1, N, 2, d) * 3
    k = torch.randn(1, N, 1, d) * 3
    r = F.blasst_rule(q, k, sf, step_q=8, step_kv=16)
    want = sum(_naive_blasst(q[0, :, h], k[0, :, 0], sf, 8, 16) for h in range(2)) / 2
    assert r["retained_fraction"] == pytest.approx(want, abs=1e-9)
    om = r["omitted_mass"]
    assert om.shape == (1, 2, N)
    if sf == 0.0:
        assert r["retained_fraction"] == 1.0 and float(om.abs().max()) < 1e-6
    # the bound: omitted / retained < sf * L_q / N per row
    Lq = torch.arange(1, N + 1, dtype=torch.float32)
    bound = sf * Lq / N / (1 + sf * Lq / N)
    assert bool((om <= bound + 1e-5).all())


def test_systems_by_name_and_unsupported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)     # import flashinfer -> ImportError
    monkeypatch.setattr(F, "_FI", {})
    sys_ = S.all_systems(["flashinfer", "flashinfer_skip_softmax", "mala"], taus=(1.0,),
                         fi_scale_factors=[4.0, 16.0])
    names = [s.name for s in sys_]
    assert names == ["flashinfer", "flashinfer_sf4", "flashinfer_sf16", "mala_tau1"]
    dense, sf4 = sys_[0], sys_[1]
    assert isinstance(dense, S.System) and dense.forward_only
    assert dense.tau == 0.0 and not dense.sparse and sf4.sparse and sf4.tau == 4.0
    why = sf4.available()
    assert why and why.startswith("flashinfer not importable")
    # without --fi-scale-factors the taus are used
    assert [s.name for s in S.all_systems(["flashinfer_skip_softmax"], taus=(1.0, 2.0))] == \
        ["flashinfer_sf1", "flashinfer_sf2"]
    with pytest.raises(S.Unsupported):
        sf4.prepare_decode(None, None, None)


def test_forward_only_prepare(monkeypatch):
    s = S.flashinfer_system(1.0)
    q, k, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 1, 4), torch.randn(1, 8, 1, 4)
    p = s.prepare(q, k, v, None)
    assert p.q.shape == (8, 2, 4) and p.kv.shape == (8, 2, 1, 4)
    with pytest.raises(S.Unsupported):
        p.fwd_bwd()


def test_device_reason():
    assert F.device_reason((9, 0)) is None
    assert "sm_90 only" in F.device_reason((10, 0))


def test_plan_and_issue_format():
    args = SK.parse([])
    plan = SK.plan(args)
    assert {p["N"] for p in plan} == {8192, 32768, 131072}
    inputs = {p["input"] for p in plan}
    assert "random" in inputs and any(i.startswith("synthetic") for i in inputs)
    names = set(plan[0]["systems"])
    assert {"mala_tau1", "mala_tau64", "mala_tau0", "flashinfer", "fa4", "sdpa_cudnn"} <= names
    rec = {"section": "fwd", "system": "flashinfer_sf4", "tau": 4.0, "regime": "synthetic",
           "sharpness": 3.0, "N": 8192, "status": "ok", "ms": 1.5, "fwd_retained_fraction": 0.3,
           "omitted_mass_mean": 1e-3, "omitted_mass_p95": 2e-3, "rel_l2_o": 4e-3}
    row = SK.to_issue_row(rec)
    assert row == {"N": 8192, "input": "synthetic(s=3)", "system": "flashinfer_skip_softmax",
                   "knob": 4.0, "ms": 1.5, "retained": 0.3, "omitted_mean": 1e-3,
                   "omitted_p95": 2e-3, "o_err": 4e-3}


def test_critical_curve_matches_rule():
    torch.manual_seed(1)
    q = torch.randn(1, 128, 2, 16) * 3
    k = torch.randn(1, 128, 1, 16) * 3
    crit = F.blasst_critical(q, k, step_q=8, step_kv=16)
    for sf in (0.5, 4.0, 64.0):
        r = F.blasst_rule(q, k, sf, step_q=8, step_kv=16)["retained_fraction"]
        assert F.retained_at(crit, sf) == pytest.approx(r, abs=1e-9)
    target = F.retained_at(crit, 8.0)
    sf = F.matched_scale_factor(crit, target)
    assert F.retained_at(crit, sf) == pytest.approx(target, abs=0.02)

"""CPU tests of the suite's own pieces:  python3 -m pytest lab/suite/test_suite.py

The generator against the C++ one is checked by check_generator.py (it compiles src/workload.cpp).
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rule_model  # noqa: E402
import timing  # noqa: E402
import workloads  # noqa: E402


def _naive_rule(q, k, tau, T):
    """Row-by-row, tile-by-tile transcription of the forward rule (one batch, all heads)."""
    B, N, Hq, d = q.shape
    g = Hq // k.shape[2]
    nT = (N + T - 1) // T
    retained = 0
    lse = torch.empty(Hq, N, dtype=torch.float64)
    for h in range(Hq):
        qh = q[0, :, h].double()
        kh = k[0, :, h // g].double()
        for i in range(nT):
            rows = range(i * T, min(N, (i + 1) * T))
            m = {r: -math.inf for r in rows}
            l_ = {r: 0.0 for r in rows}
            for j in range(i, -1, -1):
                keys = range(j * T, min(N, (j + 1) * T))
                s = {r: [float(qh[r] @ kh[c]) / math.sqrt(d) for c in keys if c <= r] for r in rows}
                keep = False
                for r in rows:
                    if not s[r]:
                        continue
                    rm = max(s[r])
                    lhs = math.inf if l_[r] == 0 else rm - m[r] - math.log(l_[r])
                    rhs = (math.log(tau) if tau > 0 else -math.inf) - math.log(r + 1)
                    if lhs >= rhs:
                        keep = True
                if not keep:
                    continue
                retained += 1
                for r in rows:
                    if not s[r]:
                        continue
                    mn = max(m[r], max(s[r]))
                    l_[r] = l_[r] * math.exp(m[r] - mn) + sum(math.exp(x - mn) for x in s[r])
                    m[r] = mn
            for r in rows:
                lse[h, r] = m[r] + math.log(l_[r])
    legal = Hq * nT * (nT + 1) // 2
    return retained / legal, lse


@pytest.mark.parametrize("sharp,tau", [(0.0, 1.0), (20.0, 1.0), (20.0, 0.0), (64.0, 4.0)])
def test_rule_model_matches_naive(sharp, tau):
    N, T = 96, 16
    q, k, _, _ = workloads.make_workload("synthetic" if sharp else "random", 1, N, 2, 1, 16, sharp, 5,
                                         device="cpu", with_dout=False)
    got = rule_model.forward_rule(q, k, tau, T, T)
    frac, lse = _naive_rule(q, k, tau, T)
    assert got["retained_fraction"] == pytest.approx(frac)
    assert torch.allclose(got["lse"][0].double(), lse, atol=1e-4)
    if tau == 0:
        assert frac == 1.0


def test_dense_lse():
    q, k, _, _ = workloads.make_workload("random", 1, 300, 4, 2, 32, 0.0, 1, device="cpu", with_dout=False)
    ref = rule_model.dense_lse(q, k, chunk=64)
    s = torch.einsum("bmhd,bnhd->bhmn", q.double(), k.double().repeat_interleave(2, 2)) / math.sqrt(32)
    s = s.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), -math.inf)
    assert torch.allclose(ref.double(), torch.logsumexp(s, -1), atol=1e-4)


def test_workload_deterministic_and_chunked():
    a = workloads.make_workload("synthetic", 1, 257, 4, 2, 8, 3.0, 9, device="cpu")
    old = workloads.CHUNK
    try:
        workloads.CHUNK = 1000  # chunk boundaries inside rows must not change values
        b = workloads.make_workload("synthetic", 1, 257, 4, 2, 8, 3.0, 9, device="cpu")
    finally:
        workloads.CHUNK = old
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_causal_block_mask_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    import systems
    for n in (128, 640, 1024):
        a = systems.causal_block_mask(n, "cpu")
        b = create_block_mask(lambda b_, h, q_, kv: q_ >= kv, None, None, n, n, device="cpu")
        assert torch.equal(a.to_dense(), b.to_dense())


def test_flops():
    # 4 * N * (N+1)/2 * d * H for causal self-attention
    assert timing.causal_flops_fwd(1, 1024, 1024, 8, 128) == 4 * 1024 * (1025 / 2) * 128 * 8
    assert timing.causal_flops_fwd(2, 1, 4096, 8, 128) == 4 * 4096 * 128 * 8 * 2


def test_kernels_vs_fa4_rows_pair_each_mala_record_with_its_own_shapes_baselines(tmp_path):
    import json

    import kernels_vs_fa4

    def rec(system, ms, status="ok", tau=None, N=8192, Hq=8, Hkv=1, op="fwd", **kw):
        return dict(section="fa4", op=op, system=system, tau=tau, regime="random", sharpness=0.0, B=1, N=N,
                    Hq=Hq, Hkv=Hkv, d=128, status=status, ms=ms, **kw)

    data = {"meta": {"device": "GPU X"}, "records": [
        rec("mala_tau1", 2.0, tau=1.0, fwd_slots_mean=100.0, fwd_retained_fraction=0.5),
        rec("mala_tau0", 2.5, tau=0.0),
        rec("fa4", 3.0), rec("sdpa_cudnn", 4.0),
        # another head layout: its own baselines only; FA4 unavailable there
        rec("mala_tau1", 5.0, tau=1.0, Hq=12, Hkv=2), rec("fa4", None, status="unavailable", Hq=12, Hkv=2),
        rec("sdpa_cudnn", 6.0, Hq=12, Hkv=2),
        rec("mala_tau1", 1.0, tau=1.0, op="fwd_bwd"),  # not an op of the table
        dict(rec("mala_tau1", 9.0, tau=1.0), section="decode"),  # not a training section
    ]}
    rows = kernels_vs_fa4.rows(data)
    assert [(r["heads"], r["tau"]) for r in rows] == [("12/2", 1.0), ("8/1", 0.0), ("8/1", 1.0)]
    r = rows[2]
    assert r["mala_ms"] == 2.0 and r["fa4_ms"] == 3.0 and r["cudnn_ms"] == 4.0 and r["device"] == "GPU X"
    assert r["vs_fa4"] == pytest.approx(1.5) and r["vs_cudnn"] == pytest.approx(2.0)
    assert r["fwd_slots"] == 100.0 and r["retained_fwd"] == 0.5 and r["input"] == "random"
    assert rows[1]["vs_fa4"] == pytest.approx(1.2)
    assert rows[0]["fa4_ms"] is None and rows[0]["fa4_status"] == "unavailable" and rows[0]["vs_cudnn"] == 1.2
    p = tmp_path / "results.json"
    p.write_text(json.dumps(data))
    out = tmp_path / "t" / "kernels_vs_fa4.json"
    assert kernels_vs_fa4.main([str(p), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == rows

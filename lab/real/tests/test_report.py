"""The statistics of lab/real/qwen_report.py (bootstrap intervals, summaries)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qwen_report as r  # noqa: E402


def test_bootstrap_interval_covers_and_shrinks():
    rng = np.random.default_rng(0)
    small = rng.normal(1.0, 1.0, 50)
    big = rng.normal(1.0, 1.0, 5000)
    lo_s, hi_s = r.bootstrap_ci(small)
    lo_b, hi_b = r.bootstrap_ci(big)
    assert lo_s < small.mean() < hi_s and lo_b < big.mean() < hi_b
    assert (hi_b - lo_b) < (hi_s - lo_s) / 5  # ~sqrt(100) narrower
    assert abs((hi_b - lo_b) - 2 * 1.96 / np.sqrt(5000)) < 0.02
    assert r.bootstrap_ci(np.full(30, 2.5)) == (2.5, 2.5)


def test_p95_and_units():
    x = np.arange(1, 101, dtype=float)
    d = r.describe_units(x.reshape(4, 5, 5))
    assert d["mean"] == 50.5 and d["n_units"] == 100
    assert abs(d["p95"] - 95.05) < 1e-9
    assert d["p95_ci"][0] <= d["p95"] <= d["p95_ci"][1]


def _raw():
    S, L, H, Hkv = 2, 3, 4, 2
    rng = np.random.default_rng(1)
    u = lambda h=H: rng.uniform(0.1, 0.9, (S, L, h)).tolist()  # noqa: E731
    rec = {k: u() for k in ("fwd_slots", "bwd_slots", "fwd_retained", "bwd_retained", "omitted_mean", "omitted_p95",
                            "omitted_max", "o_err", "dq_err")}
    rec.update(dk_err=u(Hkv), dv_err=u(Hkv))
    speed = {s: {"fwd_ms": [1.0, 2.0, 3.0], "bwd_ms": [2.0, 4.0, 6.0]} for s in ("mala_tau1", "mala_tau0", "cudnn")}
    speed["mala_tau0"] = {"fwd_ms": [2.0, 2.0, 2.0], "bwd_ms": [3.0, 3.0, 3.0]}
    return {"model": {"name": "tiny", "file": "t.gguf"}, "text": {"source": "s", "python": "3", "n_tokens": 64,
            "sequences": [{"package": "a"}, {"package": "b"}]}, "device": "cpu", "torch": "x", "mala_commit": "c",
            "date": "d", "args": {"tau": 1.0},
            "states": {"lengths": {"64": rec}, "sweep": {"64": {"1": rec, "0.5": rec}},
                       "loss": {"64": {"mean": [1.0, 2.0], "last_half": [0.5, 1.5]}}, "tiles": {}},
            "speed": {"64": speed}}


def test_summary_fields_and_sums():
    raw = _raw()
    s = r.summarize(raw)
    L = s["lengths"]["64"]
    for k in ("fwd_slots_mean", "bwd_slots_mean", "fwd_retained", "omitted_mass_mean", "omitted_mass_p95",
              "o_err_mean", "dq_err_mean", "dk_err_mean", "dv_err_mean"):
        assert isinstance(L[k], float), k
    assert L["fwd_ms"] == {"mala_tau1": 6.0, "mala_tau0": 6.0, "cudnn": 6.0}
    assert L["bwd_ms"]["mala_tau0"] == 9.0 and L["loss_mean"] == 1.5
    assert abs(L["o_err_mean"] - np.mean(raw["states"]["lengths"]["64"]["o_err"])) < 1e-12
    assert abs(L["omitted_mass_p95"] - np.quantile(raw["states"]["lengths"]["64"]["omitted_mean"], 0.95)) < 1e-12
    assert set(s["tau_sweep"]["points"]) == {"0.5", "1"} and s["tau_sweep"]["points"]["1"]["bound"] == 0.5
    t = r.tables(s, raw)
    assert "1.000x" in t["speed"] and t["layers"].count("\n") == 2 + 3 - 1

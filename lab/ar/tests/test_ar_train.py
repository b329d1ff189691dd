"""CPU smoke tests of the study's loop (lab/ar/ar_train.py): dense attention learns a tiny MQAR
well above chance, every method trains a few steps and writes its cell, cells collect into the
summary, and the bootstrap interval behaves."""

import json
import os
import sys

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ar_train  # noqa: E402

# 4 pairs in 32 tokens, 16 values: chance is 1/16.  Ceiling 8 keys, MoBA blocks of 4, NSA's own
# budget (window 0, blocks of 4) never runs on the CPU.
TINY = ["--seqlen", "32", "--n-kv", "4", "--n-q", "4", "--vocab", "32", "--d-model", "32", "--batch", "32",
        "--lr", "1e-2", "--warmup", "10", "--n-train", "2048", "--n-test", "128", "--log-every", "0",
        "--ceiling", "8", "--moba-block", "4", "--nsa-window", "0", "--nsa-block", "4", "--device", "cpu"]
CHANCE = 1 / 16


def _train(tmp_path, method, steps, *extra):
    out = tmp_path / f"{method}.json"
    args = ar_train.parser().parse_args(["train", "--method", method, "--steps", str(steps), "--out", str(out)]
                                        + TINY + list(extra))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    try:
        cell = ar_train.run_train(args, log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["method"] == method
    return cell


def test_full_learns_well_above_chance(tmp_path):
    cell = _train(tmp_path, "full", 200)
    assert cell["accuracy"] > 3 * CHANCE
    lo, hi = cell["ci95"]
    assert 2 * CHANCE < lo <= cell["accuracy"] <= hi
    assert cell["mean_slots"] == pytest.approx(16.5)  # (32 + 1) / 2 keys per row, causal


@pytest.mark.parametrize("method", ["mala", "swa", "moba", "dsa"])
def test_every_method_runs(tmp_path, method):
    if method == "mala":
        pytest.importorskip("mala")
    cell = _train(tmp_path, method, 3, "--skip-steps", "1", "--seeds", "0", "1")
    assert cell["seeds"] == [0, 1] and len(cell["runs"]) == 2
    assert 0.0 <= cell["accuracy"] <= 1.0 and cell["step_ms"] > 0
    assert all(r["steps"] == 3 and np.isfinite(r["final_loss"]) for r in cell["runs"])
    if method == "mala":
        assert cell["runs"][0]["train_mean_bwd_slots"] > 0
    else:
        assert 0 < cell["mean_slots"] <= 8 < 16.5  # at or under the ceiling, below dense


def test_nsa_cell_is_skipped_with_reason_and_collect(tmp_path):
    cell = _train(tmp_path, "nsa", 3)
    assert cell["accuracy"] is None and "CUDA" in cell["skipped"]
    _train(tmp_path, "swa", 2)
    out = tmp_path / "summary" / "ar.json"  # outside the cells folder
    doc = ar_train.run_collect(ar_train.parser().parse_args(["collect", "--cells", str(tmp_path), "--out", str(out)]))
    assert [c["method"] for c in doc["cells"]] == ["swa", "nsa"]
    assert doc["device"] == "cpu" and doc["setup"]["task"]["n_kv"] == 4
    for c in doc["cells"]:
        assert {"seqlen", "d_model", "method", "accuracy", "ci95", "seeds", "mean_slots", "step_ms"} <= set(c)
    assert json.loads(out.read_text()) == doc
    # Timing cells run alone replace the concurrent runs' step times.
    tdir = tmp_path / "timing"
    tdir.mkdir()
    (tdir / "swa.json").write_text(json.dumps({"seqlen": 32, "d_model": 32, "method": "swa", "step_ms": 1.5}))
    doc = ar_train.run_collect(ar_train.parser().parse_args(["collect", "--cells", str(tmp_path), "--out", str(out),
                                                             "--timing", str(tdir)]))
    swa = doc["cells"][0]
    assert swa["step_ms"] == 1.5 and swa["step_ms_concurrent"] > 0


def test_bootstrap_ci95():
    rng = np.random.default_rng(1)
    n_q = 16
    a = rng.binomial(n_q, 0.6, size=400)
    lo, hi = ar_train.bootstrap_ci95([a], n_q)
    acc = a.sum() / (len(a) * n_q)
    assert lo < acc < hi
    se = np.sqrt(acc * (1 - acc) / (len(a) * n_q))  # independent queries here, so binomial
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.15)
    # Seeds that disagree widen the interval beyond any one seed's.
    b = rng.binomial(n_q, 0.8, size=400)
    lo2, hi2 = ar_train.bootstrap_ci95([a, b], n_q)
    assert hi2 - lo2 > 2 * (hi - lo) and lo2 < 0.7 < hi2


def test_schedule():
    assert ar_train.lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert ar_train.lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert ar_train.lr_at(99, 100, 1.0, 10) < 0.01
    assert ar_train.lr_at(20, 100, 1.0, 10, progress=0.999) < 0.01  # the time budget ends it first


def test_report_tables():
    import ar_report

    doc = {"device": "x", "setup": {}, "cells": [
        {"seqlen": 1024, "d_model": 512, "method": "mala", "accuracy": 0.9, "ci95": [0.88, 0.92], "seeds": [0, 1, 2],
         "mean_slots": 500.0, "step_ms": 12.0},
        {"seqlen": 8192, "d_model": 512, "method": "full", "accuracy": 0.5, "ci95": [0.4, 0.6], "seeds": [0],
         "mean_slots": 4096.5, "step_ms": 30.0},
        {"seqlen": 8192, "d_model": 512, "method": "nsa", "accuracy": None, "ci95": None, "seeds": [0],
         "mean_slots": None, "step_ms": None, "skipped": "no GPU"}]}
    text = ar_report.tables(doc)
    assert "| full |  | 50.00% [40.00%, 60.00%] (1) |" in text
    assert "| mala | 90.00% [88.00%, 92.00%] (3) |  |" in text
    assert "| nsa |  | skipped |" in text
    assert "| full |  | 4096 / 30 |" in text
    # full comes before mala in the method order
    assert text.index("| full |") < text.index("| mala |")

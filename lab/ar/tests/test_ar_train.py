"""CPU smoke tests of the study's loop (lab/ar/ar_train.py): dense attention learns a tiny MQAR
(recall, beyond the in-context shortcut), every method trains a few steps and writes its cell, training is step-matched
(the time cap only stops and flags), cells collect into the summary, and the bootstrap interval
behaves."""

import json
import os
import sys

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ar_train  # noqa: E402

# 4 pairs in 32 tokens, 16 values: chance is 1/16; emitting any value of the sequence (the in-context
# heuristic a model finds before recall) scores SHORTCUT = 1/4.  Ceiling 8 keys, MoBA blocks of 4, NSA's own
# budget (window 0, blocks of 4) never runs on the CPU.
TINY = ["--seqlen", "32", "--n-kv", "4", "--n-q", "4", "--vocab", "32", "--d-model", "32", "--batch", "32",
        "--lr", "3e-3", "--warmup", "10", "--n-train", "2048", "--n-test", "128", "--log-every", "0",
        "--ceiling", "8", "--moba-block", "4", "--nsa-window", "0", "--nsa-block", "4", "--device", "cpu"]
CHANCE = 1 / 16
SHORTCUT = 1 / 4


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


def test_full_learns_recall_beyond_the_shortcut(tmp_path):
    # 600 steps at lr 3e-3 reach 1.0 here; the shortcut alone stays near 1/4 (lr 1e-2, or 200 steps).
    cell = _train(tmp_path, "full", 600)
    assert cell["accuracy"] > 0.9
    lo, hi = cell["ci95"]
    assert 2 * SHORTCUT < lo <= cell["accuracy"] <= hi
    assert cell["mean_slots"] == pytest.approx(16.5)  # (32 + 1) / 2 keys per row, causal


def test_full_learns_recall_past_the_filler(tmp_path):
    # 8 pairs at the start of 128 tokens (96 filler positions), vocab 64 (shortcut 1/8): the short
    # causal conv on each attention input (--conv 3, the default) reaches 1.0 in 500 steps, loss
    # 0.002; the first model (--conv 0: rotary attention alone has to learn the previous-token
    # step) ends at the shortcut, accuracy 0.125, loss 2.82 = ln 16.7.  About 30 s on 1 thread.
    args = ["--seqlen", "128", "--n-kv", "8", "--n-q", "8", "--vocab", "64", "--d-model", "64", "--n-test", "64",
            "--n-train", "1000000"]
    cell = _train(tmp_path, "full", 500, *args)
    assert cell["accuracy"] > 0.9 > 2 * 1 / 8


@pytest.mark.parametrize("method", ["mala", "swa", "moba", "dsa"])
def test_every_method_runs(tmp_path, method):
    if method == "mala":
        pytest.importorskip("mala")
    cell = _train(tmp_path, method, 3, "--skip-steps", "1", "--seeds", "0", "1")
    assert cell["seeds"] == [0, 1] and len(cell["runs"]) == 2
    assert 0.0 <= cell["accuracy"] <= 1.0 and cell["step_ms"] > 0
    assert all(r["steps_done"] == 3 and np.isfinite(r["final_loss"]) for r in cell["runs"])
    assert cell["steps"] == 3 and cell["steps_done"] == [3, 3] and cell["hit_time_cap"] is False
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
    assert doc["device"] == "cpu" and doc["setup"]["task"]["n_kv"] == 4 and doc["stopped_early"] == []
    for c in doc["cells"]:
        assert {"seqlen", "d_model", "method", "accuracy", "ci95", "seeds", "mean_slots", "step_ms", "steps",
                "steps_done", "hit_time_cap"} <= set(c)
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
    assert ar_train.lr_at(55, 100, 1.0, 10) == pytest.approx(0.5)
    assert ar_train.lr_at(99, 100, 1.0, 10) < 0.01


def test_step_matched_and_the_time_cap(tmp_path):
    from ar_model import ARModel

    # A seed gives every method the same batches and the same initial shared weights.
    a, b = (dict(ARModel(32, 32, m, seed=4).named_parameters()) for m in ("full", "dsa"))
    assert set(a) < set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["emb.weight"], dict(ARModel(32, 32, "full", seed=5).named_parameters())["emb.weight"])
    # The cap stops training, and the cell and the summary say so.
    cell = _train(tmp_path, "swa", 50, "--time-cap-s", "1e-9")
    assert cell["hit_time_cap"] is True and cell["steps_done"] == [0] and cell["steps"] == 50
    assert cell["accuracy"] is not None  # still evaluated, but flagged
    out = tmp_path / "summary" / "ar.json"
    doc = ar_train.run_collect(ar_train.parser().parse_args(["collect", "--cells", str(tmp_path), "--out", str(out)]))
    assert doc["stopped_early"] == ["32x32 swa: steps [0] of 50"]


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
    # A cell that stopped at the time cap is marked and listed.
    doc["cells"][1].update(hit_time_cap=True, steps_done=[120], steps=300)
    text = ar_report.tables(doc)
    assert "| full |  | 50.00% [40.00%, 60.00%] (1) * |" in text
    assert "\\* stopped at the time cap, not step-matched: full at 8,192: steps [120] of 300" in text

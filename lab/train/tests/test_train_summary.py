"""CPU tests of the study's summary over seeds (lab/train/train_summary.py): the t-interval, the
seeds found in a results folder, the averages over seeds and the paired differences."""

import json
import os
import sys

import pytest

np = pytest.importorskip("numpy")

TRAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TRAIN)

import train_summary as ts  # noqa: E402


def test_t_interval_matches_a_hand_computation():
    # mean 2, sample sd 1, n 3: half-width 4.303 / sqrt(3)
    m, lo, hi = ts.t_interval([1.0, 2.0, 3.0])
    assert m == pytest.approx(2.0)
    assert hi - m == pytest.approx(4.303 / np.sqrt(3))
    assert m - lo == pytest.approx(4.303 / np.sqrt(3))
    assert ts.t_interval([1.0]) is None


def test_size_arm_reads_arms_with_an_underscore():
    assert ts.size_arm("train_s4m_dense_ea_pt_s43.json") == ("s4m", "dense_ea")
    assert ts.size_arm("train_m13m_mala0_pt.json") == ("m13m", "mala0")
    assert ts.size_arm("train_s4m_mala_lct_s43.json") is None
    assert ts.size_arm("train_s4m_mala_pt_sx.json") is None
    assert ts.size_arm("regime.json") is None


def test_seeds_of_reads_the_run_tags(tmp_path):
    for name in ("train_s4m_mala_pt.json", "train_s4m_mala_pt_s44.json", "train_s4m_mala_pt_s43.json",
                 "train_s4m_mala_lct_s45.json", "train_s4m_dense_pt_s46.json", "train_m13m_mala_pt_s47.json"):
        (tmp_path / name).write_text("{}")
    assert ts.seeds_of(str(tmp_path), "s4m", "mala") == [42, 43, 44]
    assert ts.seeds_of(str(tmp_path), "s4m", "dense") == [46]
    assert ts.run_tag("s4m", "mala", "pt", 42) == "s4m_mala_pt"
    assert ts.run_tag("s4m", "mala", "lct", 43) == "s4m_mala_lct_s43"


def test_trained_runs_merges_seeds_across_runs_the_last_run_winning(tmp_path):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    for d, names in ((a, ("train_s4m_mala_pt.json", "train_s4m_mala_pt_s43.json", "train_s4m_dense_pt.json")),
                     (b, ("train_s4m_mala_pt_s43.json", "train_s4m_mala_pt_s45.json", "regime.json"))):
        d.mkdir()
        for name in names:
            (d / name).write_text("{}")
    where = ts.trained_runs([str(a), str(b)])
    assert where == {("s4m", "mala"): {42: str(a), 43: str(b), 45: str(b)}, ("s4m", "dense"): {42: str(a)}}


def test_over_seeds_averages_numbers_and_lists_and_keeps_the_first_seed_elsewhere():
    per = {42: {"final_heldout_loss_4k": 3.0, "fwd_slots_16k_per_layer": [1.0, 3.0], "fidelity_16k": {"a": 1}},
           43: {"final_heldout_loss_4k": 3.2, "fwd_slots_16k_per_layer": [3.0, 5.0], "fidelity_16k": {"a": 2}}}
    out = ts.over_seeds(per)
    assert out["final_heldout_loss_4k"] == pytest.approx(3.1)
    assert out["fwd_slots_16k_per_layer"] == pytest.approx([2.0, 4.0])
    assert out["fidelity_16k"] == {"a": 1}
    assert out["seeds"] == [42, 43]
    assert out["ci95"]["final_heldout_loss_4k"][0] == pytest.approx(3.1)
    assert set(out["per_seed"]) == {"42", "43"}
    single = ts.over_seeds({42: per[42]})
    assert "ci95" not in single and single["final_heldout_loss_4k"] == 3.0


def test_paired_differences_are_per_seed():
    keys = ts.LOSSES
    dense = {42: {k: 2.0 for k in keys}, 43: {k: 3.0 for k in keys}, 44: {k: 4.0 for k in keys}}
    mala = {42: {k: 2.2 for k in keys}, 43: {k: 3.0 for k in keys}, 45: {k: 9.0 for k in keys}}
    p = ts.paired(dense, mala)
    assert p["seeds"] == [42, 43]
    d = p["final_heldout_loss_4k"]
    assert d["diff"] == pytest.approx([0.2, 0.0])
    assert d["mean"] == pytest.approx(0.1)
    assert d["relative_mean"] == pytest.approx((0.1 + 0.0) / 2)
    json.dumps(p)  # serialisable


def test_pooled_counts_signs_over_every_pair():
    seeds = {s: {k: 1.0 for k in ts.LOSSES} for s in (1, 2, 3)}
    worse = {s: {k: 1.0 + 0.01 * s for k in ts.LOSSES} for s in (1, 2, 3)}
    mixed = {1: {k: 0.99 for k in ts.LOSSES}, 2: {k: 1.02 for k in ts.LOSSES}}
    p = ts.pooled({"a": ts.paired(seeds, worse), "b": ts.paired({1: seeds[1], 2: seeds[2]}, mixed)})
    k = p["final_heldout_loss_4k"]
    assert k["pairs"] == 5 and k["positive"] == 4
    assert k["sign_test_p"] == (5 + 1) / 32  # P(>= 4 heads of 5)
    assert k["relative_mean_ci95"][0] == pytest.approx((0.01 + 0.02 + 0.03 - 0.01 + 0.02) / 5)


def test_exact_arms_spread_and_mala_against_their_mean():
    def arm(vals):
        return {s: {k: v for k in ts.LOSSES} for s, v in vals.items()}

    per_arm = {"dense": arm({42: 2.0, 43: 3.0}), "dense_ea": arm({42: 2.2, 43: 3.0}),
               "mala0": arm({42: 2.1, 43: 3.3}), "mala": arm({42: 2.31, 43: 3.1})}
    e = ts.exact_arms(per_arm)
    assert e["arms"] == ["dense", "dense_ea", "mala0"] and e["seeds"] == [42, 43]
    k = e["final_heldout_loss_4k"]
    assert k["runs"]["42"] == {"dense": 2.0, "dense_ea": 2.2, "mala0": 2.1}
    # Deviations from each seed's mean, relative: seed 42 (-0.1, +0.1, 0) / 2.1, seed 43 (-0.1, -0.1, +0.2) / 3.1;
    # pooled over 2 x (3 - 1) degrees of freedom.
    dev = [-0.1 / 2.1, 0.1 / 2.1, 0.0, -0.1 / 3.1, -0.1 / 3.1, 0.2 / 3.1]
    assert k["run_sd_relative"] == pytest.approx(np.sqrt(sum(x * x for x in dev) / 4))
    assert k["mala_minus_exact_mean_relative"] == pytest.approx([0.21 / 2.1, 0.0])
    # mala and mala0 against dense and dense_ea, per seed: 42: 2.31 > 2.0, 2.2; 2.1 > 2.0, < 2.2;
    # 43: 3.1 > 3.0, 3.0; 3.3 > both.
    assert k["mala_kernels_above_sdpa"] == [7, 8]
    assert ts.exact_arms({"dense": per_arm["dense"], "mala": per_arm["mala"]}) is None
    json.dumps(e)


def test_gap_over_training_pairs_seeds_at_common_steps():
    def pt(seed, losses):
        return {"seed": seed, "evals": [{"step": 100 * i, "len_4096": {"loss": x}} for i, x in enumerate(losses)]}

    runs = {"dense": [(pt(42, [4.0, 3.0, 2.0]), None), (pt(43, [4.0, 3.0]), None)],
            "mala": [(pt(43, [4.0, 3.3, 9.9]), None), (pt(42, [4.0, 3.0, 2.2]), None)]}
    g = ts.gap_over_training(runs)
    assert set(g) == {"mala_minus_dense"}
    g = g["mala_minus_dense"]
    assert g["seeds"] == [42, 43] and g["steps"] == [0, 100]  # seed 43's dense run has no step 200
    assert g["relative"][1] == pytest.approx([0.0, 0.1])
    assert g["mean"] == pytest.approx([0.0, 0.05])


def test_probed_seeds_reads_every_seed_that_probed():
    probes = [{"step": 0, "sdpa": {"attn_rel_err": 0.01, "attn_bias": 0.0}}]
    per = {42: {"final_heldout_loss_4k": 3.0}, 45: {"final_heldout_loss_4k": 3.1, "grad_probes_pt": probes}}
    assert ts.probed_seeds(ts.over_seeds(per)) == [(45, probes)]  # the first seed did not probe
    assert ts.probed_seeds(ts.over_seeds({45: per[45]})) == [(45, probes)]
    assert ts.probed_seeds(ts.over_seeds({42: per[42]})) == []

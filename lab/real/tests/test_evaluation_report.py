"""lab/real/evaluation_report.py: the summary evaluation.json from small result files of the
model-in-the-loop scripts (the shapes qwen_niah.py, qwen_e2e.py and qwen_train.py write)."""

import json
import sys

import script_fixtures  # noqa: F401  (puts lab/real on sys.path)


def _write(d, name, obj):
    with open(d / name, "w") as f:
        json.dump(obj, f)


def test_summary_keys_and_values(tmp_path, monkeypatch):
    import evaluation_report

    _write(tmp_path, "qwen_niah.json", {
        "device": "gpu", "niah": {"4096": {"trials": 2, "dense": 100.0, "mala_tau1": 50.0}},
        "raw": {"4096/single": {"trials": [{}, {}], "dense": {"outputs": [" 12", " 7"]},
                                "mala_tau1": {"outputs": [" 12", " 8"]}}}})
    _write(tmp_path, "qwen_e2e.json", {
        "device": "gpu",
        "prefill": {"8192": {"package": "asyncio", "ms": {"sdpa_cudnn": 2.0, "mala_tau1": 1.5},
                             "slots_per_query": {"mala_tau1": 3000.0}, "dense_slots_per_query": 4096.5}},
        "decode": {"1": {"context": 100, "steps": 2, "graphs": True,
                         "mala_tau0": {"ms_per_step": 1.0, "tokens_per_s": 1000.0, "slots_per_query": 128.0,
                                       "retained": 1.0, "tokens": [[1, 2]]},
                         "mala_tau1_seeded": {"ms_per_step": 0.5, "tokens_per_s": 2000.0, "slots_per_query": 64.0,
                                              "retained": 0.5, "tokens": [[1, 3]]}}}})
    step = lambda i, loss, extra=None: {"step": i, "loss": loss, "seconds": 1.0, **(extra or {})}  # noqa: E731
    flops = {"fwd_slots_per_query": 10.0, "bwd_slots_per_query": 12.0, "attention_flops_per_token": 90.0,
             "dense_attention_flops_per_token": 100.0}
    for name, final, extra in (("dense", 2.0, None), ("mala", 2.02, flops)):
        _write(tmp_path, f"qwen_train_{name}.json", {
            "device": "gpu", "completed_steps": 2, "median_step_seconds": 1.0, "text": {"held_out": ["http"]},
            "steps": [step(1, 3.0), step(2, 2.5 if name == "dense" else 2.75, extra)],
            "evals": [{"step": 0, "held_out_loss": 2.5}, {"step": 2, "held_out_loss": final}],
            "final": {"step": 2, "held_out_loss": final}})
    monkeypatch.setattr(sys, "argv", ["evaluation_report.py", "--dir", str(tmp_path)])
    evaluation_report.main()
    doc = json.load(open(tmp_path / "evaluation.json"))
    assert "perplexity" not in doc  # its file is missing
    assert doc["niah"]["4096"]["mala_tau1"] == 50.0
    assert set(doc["niah"]) == {"4096"}
    assert doc["niah_identical_answers"]["mala_tau1"] == {"same": 1, "trials": 2}
    dec = doc["end_to_end"]["decode"]["1"]
    assert dec["mala_tau1_seeded"]["tokens_equal_to_mala_tau0"] == 0.5
    assert doc["end_to_end"]["prefill"]["8192"]["ms"]["mala_tau1"] == 1.5
    t = doc["training"]
    assert t["dense_final_loss"] == 2.0 and t["mala_final_loss"] == 2.02 and t["steps"] == 2
    assert abs(t["final_loss_rel_diff"] - 0.01) < 1e-12
    assert abs(t["train_loss_mean_abs_rel_diff"] - 0.05) < 1e-12  # (0 + 0.1) / 2
    assert t["mala_attention_flops_per_token"] == 90.0 and t["dense_attention_flops_per_token"] == 100.0

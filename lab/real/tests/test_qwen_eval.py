"""lab/real/qwen_eval.py (perplexity with MALA in every layer) end to end on the CPU, on a tiny GGUF
written here: the summary's structure, dense against MALA at tau = 0 (the exact CPU implementation:
equal up to fp32 rounding), and the realized slots.

    .venv-real/bin/python -m pytest lab/real/tests     (CI: scripts/dev.sh test)
"""

import json
import math

import pytest

from script_fixtures import require_model_stack, run_script, tiny_model  # noqa: F401  (fixtures)


def test_perplexity_dense_and_mala(tmp_path, tiny_model, run_script):
    require_model_stack()
    import qwen_eval

    out = tmp_path / "out"
    run_script(qwen_eval, "--gguf", tiny_model, "--out", out, "--work", tmp_path / "w", "--lengths", "256",
               "--sequences", "2", "--taus", "0,1")
    with open(out / "qwen_eval.json") as f:
        res = json.load(f)
    e = res["perplexity"]["256"]
    assert e["sequences"] == 2 and len(res["raw"]["256"]["packages"]) == 2
    assert math.isfinite(e["dense"]) and e["dense"] > 1
    # tau = 0 is exact dense attention: only the summation order differs.
    assert abs(e["mala_tau0_rel_diff"]) < 1e-4
    assert abs(e["mala_tau1"] / e["dense"] - 1) < 0.05
    # Work: tau = 0 retains every legal tile (CPU tiles 128: 2 tiles for half the rows of 256).
    assert e["mala_tau0_slots_per_query"] == pytest.approx(192.0)
    assert 0 < e["mala_tau1_slots_per_query"] <= e["mala_tau0_slots_per_query"]
    for name in ("mala_tau0", "mala_tau1"):
        assert len(res["raw"]["256"][name]["loss"]) == 2

"""lab/real/recipe.py (the inference-recipe study, issue #66 part 3) on the CPU, on a tiny GGUF: every
MALA arm of the default list runs end to end and the JSON has the issue's format; the per-layer spec
parser; the selection rule on hand-made numbers; the fi_skip arm's Unsupported off the GPU; the merge
into the peers file.  (Timings and the tiny model's accuracies mean nothing here.)

    .venv-real/bin/python -m pytest lab/real/tests     (CI: scripts/dev.sh test)
"""

import json
import types

import pytest

from script_fixtures import require_model_stack, run_script, tiny_model  # noqa: F401  (fixtures)

import recipe  # noqa: E402  (script_fixtures put lab/real on the path)


def test_layer_spec_parser():
    assert recipe.parse_layer_spec("0=0,default=4") == {0: 0.0, "default": 4.0}
    assert recipe.parse_layer_spec("first2=0,default=8") == {0: 0.0, 1: 0.0, "default": 8.0}
    assert recipe.parse_layer_spec("first2=0, 5=1.5,default=64") == {0: 0.0, 1: 0.0, 5: 1.5, "default": 64.0}
    for bad, why in (("0=0", "no default"), ("0=0,0=1,default=4", "twice"), ("first2=0,1=2,default=1", "twice"),
                     ("x=1,default=4", "not a layer index"), ("0=-1,default=4", ">= 0"), ("0,default=4", "KEY=TAU"),
                     ("0=inf,default=4", ">= 0"), ("first0=1,default=2", "not a layer index"),
                     ("0=a,default=1", "not a number")):
        with pytest.raises(ValueError, match=why):
            recipe.parse_layer_spec(bad)


def test_arm_parser():
    a = recipe.parse_arm("mala_layers:0=0,default=4")
    assert (a["rule"], a["system"], a["knob"], a["tau"]) == ("mala_layers", "mala_per_layer", "0=0,default=4",
                                                              {0: 0.0, "default": 4.0})
    assert recipe.parse_arm("mala:tau=16")["tau"] == 16.0
    f = recipe.parse_arm("fi_skip:sf=64")
    assert (f["system"], f["knob"], f["tau"]) == ("flashinfer_skip_softmax", 64.0, None)
    assert [a["arm"] for a in recipe.parse_arms("mala:tau=1 sdpa_cudnn")] == ["sdpa_cudnn", "mala:tau=1"]
    assert recipe.parse_arms("mala:tau=1")[0]["rule"] == "dense"  # added when missing
    for bad in ("mala", "mala:t=1", "flash", "fi_skip:16", "sdpa_cudnn:x"):
        with pytest.raises(ValueError, match="arm"):
            recipe.parse_arm(bad)


def _row(arm, ms, ppl, niah, status="ok"):
    a = recipe.parse_arm(arm)
    return {"arm": arm, "rule": a["rule"], "system": a["system"], "knob": a["knob"], "status": status,
            "prefill_ms": ms, "ppl_32k": ppl, "niah_multikey_32k": niah}


def test_selection_rule():
    rows = [_row("sdpa_cudnn", 360.0, 2.7744, 84.0),
            _row("mala:tau=1", 330.0, 2.7740, 84.0),
            _row("mala:tau=4", 300.0, 2.7800, 82.0),        # ppl +0.20%, niah -2: qualifies (the bounds)
            _row("mala:tau=16", 250.0, 2.7744, 80.0),       # niah -4: out
            _row("mala:tau=64", 200.0, 2.7900, 84.0),       # ppl +0.56%: out
            _row("mala_layers:0=0,default=16", 270.0, 2.7750, 86.0),  # better than dense: in
            _row("mala_layers:0=0,default=64", 240.0, 2.9, 60.0),
            _row("fi_skip:sf=16", 280.0, 2.80, 84.0),       # ppl +0.92%: out
            _row("fi_skip:sf=1", None, None, None, status="unsupported")]
    sel = recipe.select(rows)
    assert sel["mala"]["arm"] == "mala:tau=4" and sel["mala"]["speedup"] == pytest.approx(1.2)
    assert not sel["mala"]["meets_target"]
    assert sel["mala_layers"]["arm"] == "mala_layers:0=0,default=16" and sel["mala_layers"]["meets_target"]
    assert sel["fi_skip"] is None
    assert sel["best"]["arm"] == "mala_layers:0=0,default=16"
    assert sel["criteria"]["against"] == "sdpa_cudnn"
    # Tighter tolerances: only tau = 1 holds; without a dense row nothing qualifies.
    assert recipe.select(rows, niah_points=1.0, ppl_rel=0.0001)["mala"]["arm"] == "mala:tau=1"
    none = recipe.select(rows[1:])
    assert all(none[r] is None for r in recipe.RULES) and none["best"] is None


def test_fi_skip_is_unsupported_off_the_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    import qwen_measure as qm

    monkeypatch.setitem(qm.DEVICE, "name", "cpu")
    cfg = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    _, S = recipe._suite()
    with pytest.raises(S.Unsupported) as e:
        recipe.fi_system_for(16.0, types.SimpleNamespace(config=cfg))
    msg = str(e.value)
    assert msg.startswith("fi_skip: ") and "CUDA only" in msg and "head size 16" in msg
    if not torch.cuda.is_available():
        assert "flashinfer" in msg


def test_per_layer_tau_reaches_each_layer(monkeypatch):
    torch = require_model_stack()
    import mala
    import qwen_eval

    seen = []
    monkeypatch.setattr(mala, "attention", lambda q, k, v, tau, **kw: seen.append(tau) or q)
    monkeypatch.setitem(qwen_eval.MODE, "tau", {0: 0.0, "default": 4.0})
    monkeypatch.setitem(qwen_eval.MODE, "stats", None)
    x = torch.zeros(1, 2, 8, 4)
    for i in range(3):
        qwen_eval.eval_attention(types.SimpleNamespace(layer_idx=i), x, x, x, None)
    assert seen == [0.0, 4.0, 4.0]


def test_script_runs_every_arm(tmp_path, monkeypatch, tiny_model, run_script):
    require_model_stack()
    import mala

    taus = set()
    real = mala.attention

    def attention(*a, **k):
        taus.add(k["tau"])
        return real(*a, **k)

    monkeypatch.setattr(mala, "attention", attention)
    out = tmp_path / "out"
    run_script(recipe, "--gguf", tiny_model, "--out", out, "--work", tmp_path / "w", "--n", "512",
               "--sequences", "2", "--trials", "2", "--reps", "1", "--new-tokens", "3")
    with open(out / "recipe.json") as f:
        res = json.load(f)
    rows = {r["arm"]: r for r in res["real"]}
    assert list(rows) == list(recipe.DEFAULT_ARMS) and res["N"] == 512 and res["trials"] == 2
    assert {0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0} <= taus  # every tau, and the per-layer specs' layer 0
    for arm, r in rows.items():
        assert {"system", "knob", "prefill_ms", "retained", "ppl_32k", "niah_multikey_32k"} <= set(r) or \
            r["status"] != "ok"
        if r["rule"] == "fi_skip":
            assert r["status"] == "unsupported" and r["reason"].startswith("fi_skip: ")
            assert 0 < r["retained"] <= 1  # the rule replayed on the model's own Q, K
            continue
        assert r["status"] == "ok" and r["prefill_ms"] > 0 and 0 < r["attention_ms"] <= r["prefill_ms"] * 1.5
        assert 0 < r["retained"] <= 1 and r["ppl_32k"] > 1 and 0 <= r["niah_multikey_32k"] <= 100
        lo, hi = r["niah_multikey_32k_ci95"]
        assert lo <= r["niah_multikey_32k"] <= hi
        assert len(res["raw"][arm]["loss"]) == 2 and len(res["raw"][arm]["niah_outputs"]) == 2
        if r["rule"] != "dense":
            assert "ppl_rel_diff" in r and 0 <= r["niah_disagreements"] <= 2 and r["speedup_vs_cudnn"] > 0
    assert rows["sdpa_cudnn"]["retained"] == 1.0
    assert rows["mala_layers:0=0,default=4"]["tau_per_layer"] == {"0": 0.0, "default": 4.0}
    # A larger tau retains no more (the tiny model at 512 tokens keeps every tile: equal here).
    assert rows["mala:tau=64"]["retained"] <= rows["mala:tau=1"]["retained"]
    assert set(res["selection"]) == {"criteria", "best", *recipe.RULES}
    # The merge keeps the peers file's other keys.
    peers = tmp_path / "peers" / "skip_softmax.json"
    peers.parent.mkdir()
    peers.write_text(json.dumps({"device": "H200", "synthetic": [{"N": 8192, "system": "mala"}]}))
    recipe.merge(str(out / "recipe.json"), str(peers))
    merged = json.loads(peers.read_text())
    assert merged["synthetic"] == [{"N": 8192, "system": "mala"}] and merged["device"] == "H200"
    assert merged["real"] == res["real"] and merged["real_selection"] == res["selection"]
    assert merged["real_meta"]["N"] == 512

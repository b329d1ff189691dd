"""lab/real/qwen_niah.py (needle retrieval with MALA in prefill and decode) on the CPU, on a tiny GGUF:
the trials' construction, and that the MALA configurations run their prefill through mala.attention
and their decode steps through mala.attention_with_kvcache.  (The tiny model retrieves nothing: the
accuracies are not checked.)

    .venv-real/bin/python -m pytest lab/real/tests     (CI: scripts/dev.sh test)
"""

import json
import random

import pytest

from script_fixtures import require_model_stack, run_script, tiny_model  # noqa: F401  (fixtures)


def test_trials_hold_their_needles(tiny_model):
    pytest.importorskip("tokenizers")
    import corpus
    import gguf_qwen2
    import qwen_niah

    tok = gguf_qwen2.tokenizer(tiny_model)
    seqs, _ = corpus.build(lambda s: tok.encode(s).ids, 2000, 1)
    rng = random.Random(0)
    for variant, needles in (("single", 1), ("multikey", 4)):
        for _ in range(5):
            ids, want, info = qwen_niah.make_trial(rng, tok, seqs[0], 1500, variant)
            text = tok.decode(ids)
            assert len(ids) <= 1500 and len(info["keys"]) == needles
            for k, v in zip(info["keys"], info["values"]):
                assert f"# The secret number of {k} is {v}." in text
            asked = info["keys"][info["asked"]]
            assert want == info["values"][info["asked"]]
            assert text.endswith(f"# Answer: the secret number of {asked} is")


def test_mala_runs_prefill_and_decode(tmp_path, monkeypatch, tiny_model, run_script):
    require_model_stack()
    import mala
    import qwen_niah

    calls = {"attention": 0, "kvcache": 0}
    real_attention, real_kvcache = mala.attention, mala.attention_with_kvcache

    def attention(*a, **k):
        calls["attention"] += 1
        return real_attention(*a, **k)

    def kvcache(*a, **k):
        calls["kvcache"] += 1
        return real_kvcache(*a, **k)

    monkeypatch.setattr(mala, "attention", attention)
    monkeypatch.setattr(mala, "attention_with_kvcache", kvcache)
    out = tmp_path / "out"
    run_script(qwen_niah, "--gguf", tiny_model, "--out", out, "--work", tmp_path / "w", "--lengths", "512",
               "--trials", "2", "--taus", "1", "--new-tokens", "3")
    with open(out / "qwen_niah.json") as f:
        res = json.load(f)
    e = res["niah"]["512"]
    assert e["trials"] == 2 and {"dense", "mala_tau1", "single_mala_tau1_ci95"} <= set(e)
    assert len(res["raw"]["512/multikey"]["mala_tau1"]["outputs"]) == 2
    layers = 2  # tiny_gguf's config
    # MALA: per trial one prefill per layer and up to (new tokens - 1) decode steps per layer (fewer
    # when the model ends the answer), 2 variants x 2 trials.
    assert calls["attention"] == 4 * layers
    assert 0 < calls["kvcache"] <= 4 * layers * 2 and calls["kvcache"] % layers == 0

"""tools/real/qwen_niah.py (needle retrieval with MALA in prefill and decode) on the CPU, on a tiny GGUF:
the trials' construction, and that the MALA configurations run their prefill through mala.attention
and their decode steps through mala.attention_with_kvcache.  (The tiny model retrieves nothing: the
accuracies are not checked.)

    .venv-real/bin/python -m pytest tools/real/tests     (CI: scripts/dev.sh test)
"""

import json
import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import tiny_gguf  # noqa: E402


def test_trials_hold_their_needles(tmp_path):
    pytest.importorskip("tokenizers")
    import corpus
    import gguf_qwen2
    import qwen_niah

    gguf = str(tmp_path / "tiny.gguf")
    tiny_gguf.write(gguf)
    tok = gguf_qwen2.tokenizer(gguf)
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


def test_mala_runs_prefill_and_decode(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    mala = pytest.importorskip("mala")
    import qwen_measure as qm
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
    gguf = str(tmp_path / "tiny.gguf")
    tiny_gguf.write(gguf)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["qwen_niah.py", "--gguf", gguf, "--out", str(out), "--work", str(tmp_path / "w"),
                                      "--lengths", "512", "--trials", "2", "--taus", "1", "--new-tokens", "3",
                                      "--device", "cpu"])
    saved = dict(qm.DEVICE)
    try:
        qwen_niah.main()
    finally:
        qm.DEVICE.update(saved)
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

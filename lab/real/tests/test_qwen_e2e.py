"""lab/real/qwen_e2e.py (end-to-end prefill and decode of the model, dense against MALA) on the CPU,
on a tiny GGUF: its hand-written static-cache decode step equals transformers' own forward, and the
script writes its summary.  (Timing and CUDA graphs only mean something on the GPU machine.)

    .venv-real/bin/python -m pytest lab/real/tests     (CI: scripts/dev.sh test)
"""

import json

import pytest

from script_fixtures import require_model_stack, run_script, tiny_model  # noqa: F401  (fixtures)


def _model(tiny_model, tmp_path):
    import argparse

    import qwen_measure as qm
    import torch

    qm.DEVICE.update(name="cpu", dtype=torch.float32)
    args = argparse.Namespace(gguf=tiny_model, work=str(tmp_path / "w"))
    res = qm.Results(str(tmp_path / "r.json"))
    _, model, _ = qm.load_model(args, res, "cpu")
    return model


@pytest.mark.parametrize("attention", [("mala", 0.0, "seeded"), ("sdpa", None, None)])
def test_static_decode_step_equals_the_model(tmp_path, tiny_model, attention):
    torch = require_model_stack()
    import qwen_e2e
    import qwen_measure as qm

    saved = dict(qm.DEVICE)
    try:
        model = _model(tiny_model, tmp_path)
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, model.config.vocab_size, (48,), generator=g).tolist() for _ in range(2)]
        context, steps = 40, 5
        caches, first = qwen_e2e.fill_caches(model, seqs, context, context + steps)
        tokens, _, slots, _ = qwen_e2e.decode_config(model, caches, context, first, attention, steps, graphs=False)
        # Greedy continuation by transformers on the whole prefix, one full forward per token.
        with torch.no_grad():
            for b, s in enumerate(seqs):
                ids = list(s[:context])
                want = []
                for _ in range(steps):
                    nxt = int(model(torch.tensor(ids).view(1, -1)).logits[0, -1].argmax())
                    want.append(nxt)
                    ids.append(nxt)
                assert tokens[b].tolist() == want
        if attention[0] == "mala":  # tau = 0: every slot of the tiles holding the first step's 41 keys
            assert slots == pytest.approx(128)  # (the CPU decode's key tiles are 128 wide)
        # The step's logits equal the model's on the same prefix (not only their argmax).
        dec = qwen_e2e.StaticDecoder(model, caches, [context] * 2, first, attention)
        logits = dec.step()[:, 0]
        with torch.no_grad():
            full = model(torch.tensor([s[:context] + [int(f)] for s, f in zip(seqs, first)])).logits[:, -1]
        assert torch.allclose(logits, full, atol=1e-4, rtol=1e-4)
    finally:
        qm.DEVICE.update(saved)


def test_script_writes_prefill_and_decode(tmp_path, tiny_model, run_script):
    require_model_stack()
    import qwen_e2e

    out = tmp_path / "out"
    run_script(qwen_e2e, "--gguf", tiny_model, "--out", out, "--work", tmp_path / "w", "--lengths", "256",
               "--context", "200", "--batches", "2", "--new-tokens", "3", "--reps", "1")
    with open(out / "qwen_e2e.json") as f:
        res = json.load(f)
    p = res["prefill"]["256"]
    assert set(p["ms"]) == {"sdpa", "mala_tau0", "mala_tau1"} and all(v > 0 for v in p["ms"].values())
    assert p["slots_per_query"]["mala_tau0"] >= p["slots_per_query"]["mala_tau1"] > 0
    d = res["decode"]["2"]
    assert {"mala_tau0", "mala_tau1_seeded", "mala_tau1_per_split", "sdpa_static"} <= set(d)
    assert d["mala_tau0"]["slots_per_query"] == pytest.approx(256)  # 201 keys in two 128-key tiles
    assert d["sdpa_static"]["steps_equal_to_tau0"] == 3  # both dense
    for name in ("mala_tau1_seeded", "mala_tau1_per_split"):
        assert 0 < d[name]["slots_per_query"] <= 256 and len(d[name]["tokens"]) == 2

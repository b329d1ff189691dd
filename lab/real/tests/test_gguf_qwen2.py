"""The GGUF -> Qwen2 loader on a tiny GGUF written here with gguf's writer (no real weights).

    .venv-real/bin/python -m pytest lab/real/tests     (CI: scripts/dev.sh test)
"""

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import gguf_qwen2 as g  # noqa: E402
import tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    c, w = tiny_gguf.write(path)
    return path, c, w


def test_config_from_header(tiny):
    path, c, _ = tiny
    d = g.describe(path)
    cfg = d["config"]
    assert cfg["num_hidden_layers"] == c["layers"] and cfg["hidden_size"] == c["hidden"]
    assert cfg["num_attention_heads"] == c["heads"] and cfg["num_key_value_heads"] == c["heads_kv"]
    assert cfg["intermediate_size"] == c["ff"] and cfg["max_position_embeddings"] == c["ctx"]
    assert cfg["rope_theta"] == c["theta"] and abs(cfg["rms_norm_eps"] - c["eps"]) < 1e-12
    assert cfg["vocab_size"] == 256 + len(tiny_gguf.MERGES) + len(tiny_gguf.SPECIALS)
    assert cfg["tie_word_embeddings"] is False
    assert d["tensor_count"] == 3 + 12 * c["layers"]
    types = {t["name"]: t["type"] for t in d["tensors"]}
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["blk.0.ffn_gate.weight"] == "F32"


def test_weights_under_transformers_names(tiny):
    path, c, w = tiny
    cfg, weights = g.load(path, threads=2)
    assert len(weights) == len(w)
    for name, a in w.items():
        got = weights[g.hf_name(name)]
        assert got.shape == a.shape, name  # [out, in], as transformers holds it
        if name == "blk.0.ffn_up.weight":  # Q8_0: dequantized within the format's step
            step = np.abs(a).reshape(a.shape[0], -1, 32).max(-1, keepdims=True) / 127
            assert np.all(np.abs(got - a).reshape(a.shape[0], -1, 32) <= step * 0.6 + 1e-7)  # fp16 scale: 0.5 + 127 * 2^-11
            assert not np.array_equal(got, a)
        else:
            np.testing.assert_array_equal(got, a, err_msg=name)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (c["heads_kv"] * c["hidden"] // c["heads"], c["hidden"])


def test_names():
    assert g.hf_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert g.hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(KeyError, match="blk.0.attn_qkv.weight"):
        g.hf_name("blk.0.attn_qkv.weight")


def test_missing_tensor_is_named(tmp_path):
    path = str(tmp_path / "missing.gguf")
    tiny_gguf.write(path, drop=("blk.1.attn_v.bias",))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias"):
        g.load(path)


def test_wrong_architecture(tmp_path):
    path = str(tmp_path / "llama.gguf")
    tiny_gguf.write(path, arch="llama")
    with pytest.raises(ValueError, match="general.architecture is 'llama'"):
        g.describe(path)


def test_tokenizer_roundtrip_and_specials(tiny):
    path, _, _ = tiny
    tok = g.tokenizer(path)
    text = "def f(x):\n    return x  # tab\there, unicode: é ü 日本\n"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert "def" in enc.tokens and "Ġx" in enc.tokens  # the merges apply
    ids = tok.encode("<|im_start|>int<|im_end|>").ids
    n = 256 + len(tiny_gguf.MERGES)
    assert ids[0] == n + 1 and ids[-1] == n + 2 and len(ids) == 3


def test_reference_forward_is_causal_and_rope_relative(tiny):
    path, _, _ = tiny
    cfg, w = g.load(path)
    m = g.ReferenceQwen2(cfg, w)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, 24)
    full = m.logits(ids)
    np.testing.assert_allclose(m.logits(ids[:10]), full[:10], rtol=1e-4, atol=1e-4)
    assert np.abs(full[10:23] - m.logits(np.concatenate([ids[:10], ids[11:]]))[10:23]).max() > 1e-3
    # RoPE: q.k depends on the positions' difference only
    q = rng.standard_normal((1, 1, cfg.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, cfg.head_dim)).astype(np.float32)
    dot = lambda a, b: float((g.rope(q, np.array([a]), cfg.rope_theta) * g.rope(k, np.array([b]), cfg.rope_theta)).sum())  # noqa: E731
    assert abs(dot(7, 3) - dot(107, 103)) < 1e-4 and abs(dot(7, 3) - dot(7, 4)) > 1e-4
    assert g.next_token_loss(full, ids) > 0


def _torch_model(tiny, dtype_name):
    """(torch, qwen_measure, cfg, numpy weights, the model qwen_measure builds on the CPU in dtype)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import qwen_measure as qm

    cfg, w = g.load(tiny[0])
    qm.DEVICE.update(name="cpu", dtype=getattr(torch, dtype_name))
    try:
        model = qm.build_model(cfg, {k: torch.from_numpy(v.copy()) for k, v in w.items()}, "cpu")
    finally:
        qm.DEVICE.update(dtype=torch.float32)
    return torch, qm, cfg, w, model


def test_torch_model_matches_reference(tiny):
    """transformers' Qwen2 built by lab/real/qwen_measure.py equals the numpy reference (fp32)."""
    torch, qm, cfg, w, model = _torch_model(tiny, "float32")
    ids = np.arange(3, 40) % cfg.vocab_size
    with torch.no_grad():
        lg = model(input_ids=torch.tensor(ids).view(1, -1)).logits[0].numpy()
    np.testing.assert_allclose(lg, g.ReferenceQwen2(cfg, w).logits(ids), rtol=2e-4, atol=2e-4)
    got = {}
    qm.CAPTURE.update(on=True, layers={})
    with torch.no_grad():
        model(input_ids=torch.tensor(ids).view(1, -1))
    qm.CAPTURE["on"] = False
    g.ReferenceQwen2(cfg, w).hidden(ids, capture=lambda i, q, k, v: got.__setitem__(i, (q, k, v)))
    for i, (q, k, v) in qm.CAPTURE["layers"].items():
        for a, b in zip((q, k, v), got[i]):
            np.testing.assert_allclose(a.numpy(), b, rtol=2e-4, atol=2e-4)


def test_torch_model_keeps_float32_rotary_frequencies(tiny):
    """A bfloat16 model still rotates with float32 frequencies (as transformers' own loading does)."""
    torch, _, cfg, _, model = _torch_model(tiny, "bfloat16")
    inv = model.model.rotary_emb.inv_freq
    want = g.rope_inv_freq(cfg.rope_theta, cfg.head_dim)
    assert inv.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert float(np.max(np.abs(inv.double().numpy() - want) / want)) < 1e-6

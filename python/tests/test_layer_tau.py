"""Per-layer tau: mala.layer_tau's spec (number, list, dict with a default, callable) and the
transformers integration resolving it by module.layer_idx, on a tiny Qwen3 (CPU, float32)."""

import math

import pytest
import torch
import torch.nn.functional as F

import mala
from conftest import rel_l2


def test_layer_tau_resolves_each_kind_of_spec():
    assert mala.layer_tau(2, 7) == 2.0 and mala.layer_tau(0.5, None) == 0.5
    assert [mala.layer_tau([0.0, 1.0, 4.0], i) for i in range(3)] == [0.0, 1.0, 4.0]
    spec = {0: 0.0, 3: 8.0, "default": 1.0}
    assert [mala.layer_tau(spec, i) for i in range(5)] == [0.0, 1.0, 1.0, 8.0, 1.0]
    assert [mala.layer_tau(lambda i: 0.0 if i == 0 else 1.0, i) for i in range(3)] == [0.0, 1.0, 1.0]
    # check_tau_spec freezes a list: editing the caller's list afterwards changes nothing.
    values = [0.0, 1.0]
    frozen = mala.api.check_tau_spec(values)
    values[1] = 9.0
    assert mala.layer_tau(frozen, 1) == 1.0


def test_layer_tau_errors_name_tau_and_the_layer():
    with pytest.raises(ValueError, match=r"^tau: the per-layer list has 2 entries, so none for layer 2"):
        mala.layer_tau([0.0, 1.0], 2)
    with pytest.raises(ValueError, match=r"^tau: the per-layer dict has no entry for layer 1 and no 'default'"):
        mala.layer_tau({0: 0.0}, 1)
    # mala.attention's check and message, naming where the value came from.
    with pytest.raises(ValueError, match=r"^tau\[1\]: must be finite and >= 0 \(got -1\)"):
        mala.layer_tau([0, -1], 1)
    with pytest.raises(ValueError, match=r"^tau\(3\): must be finite and >= 0 \(got nan\)"):
        mala.layer_tau(lambda i: math.nan, 3)
    with pytest.raises(TypeError, match=r"^tau\(0\): must be a number"):
        mala.layer_tau(lambda i: None, 0)
    with pytest.raises(ValueError, match=r"^tau\['default'\]: must be finite"):
        mala.layer_tau({"default": math.inf}, 0)
    with pytest.raises(ValueError, match=r"^tau: must be finite and >= 0"):
        mala.layer_tau(-0.5, 0)
    for bad in (None, -1, "0", True):
        with pytest.raises(ValueError, match=r"^tau: a per-layer tau needs a layer index"):
            mala.layer_tau([1.0], bad)
    # A spec is checked whole where it is given (register calls check_tau_spec).
    check = mala.api.check_tau_spec
    with pytest.raises(ValueError, match=r"^tau\[2\]: must be finite"):
        check([0.0, 1.0, -2.0])
    with pytest.raises(ValueError, match=r"^tau: a per-layer list must have one entry per layer"):
        check([])
    with pytest.raises(ValueError, match=r"^tau: a per-layer dict's keys"):
        check({"first": 0.0})
    with pytest.raises(ValueError, match=r"^tau\[0\]: must be finite"):
        check({0: math.nan})
    with pytest.raises(TypeError, match=r"^tau: must be a number"):
        check(None)


# ---- transformers ----------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
import mala.integrations.transformers as mala_hf  # noqa: E402

LAYERS = 3


@pytest.fixture
def calls(monkeypatch):
    """Every mala.attention call of the integration, in layer order: (tau, q, k, v, out)."""
    seen = []
    attention = mala.attention

    def spy(q, k, v, **kwargs):
        out = attention(q, k, v, **kwargs)
        seen.append((kwargs["tau"], q.detach(), k.detach(), v.detach(), out.detach()))
        return out

    monkeypatch.setattr(mala, "attention", spy)
    yield seen
    mala_hf.register(tau=1.0)


def _qwen3(tau, seed=0):
    mala_hf.register(tau=tau)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="mala", dtype=torch.float32)
    return model.eval()


def _ids(n=300, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_layer0_dense_and_the_others_at_their_tau(calls):
    # Layer 0 dense, layer 1 at the default tolerance, layer 2 at a tolerance so large that it skips
    # most tiles: its output must differ from dense, or the test could not tell tau from no tau.
    taus = {0: 0.0, 1: 1.0, 2: 1e6}
    model = _qwen3(lambda i: taus[i])
    with torch.no_grad():
        model(_ids())
    assert [c[0] for c in calls] == [0.0, 1.0, 1e6]
    for layer, (tau, q, k, v, out) in enumerate(calls):
        dense = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True).transpose(1, 2)
        err = rel_l2(out, dense)
        # mala.api.attention is the function the spy wraps: the same call at the layer's tau.
        assert torch.equal(out, mala.api.attention(q, k, v, tau=taus[layer])), f"layer {layer}"
        if layer == 0:
            assert err < 1e-5, f"layer 0 at tau 0 must be dense attention (rel err {err:.3g})"
        if layer == 2:
            assert err > 1e-2, f"tau 1e6 skipped nothing in layer 2 (rel err {err:.3g})"


def test_per_layer_spec_equals_the_uniform_one(calls):
    """A list of equal taus is the number: logits bit for bit; a mixed list differs from both."""
    ids = _ids(seed=1)
    with torch.no_grad():
        dense = _qwen3(0.0)(ids).logits
        listed = _qwen3([0.0] * LAYERS)(ids).logits
        by_dict = _qwen3({"default": 0.0})(ids).logits
        sparse = _qwen3(1e6)(ids).logits
        mixed = _qwen3({0: 0.0, "default": 1e6})(ids).logits
    assert torch.equal(listed, dense) and torch.equal(by_dict, dense)
    assert not torch.equal(mixed, dense) and not torch.equal(mixed, sparse)
    assert [c[0] for c in calls[-LAYERS:]] == [0.0, 1e6, 1e6]


def test_short_list_raises_at_the_first_layer_it_lacks(calls):
    model = _qwen3([0.0, 1.0])
    with pytest.raises(ValueError, match=r"^tau: the per-layer list has 2 entries, so none for layer 2"):
        with torch.no_grad():
            model(_ids(n=64))
    assert [c[0] for c in calls] == [0.0, 1.0], "layers 0 and 1 ran before layer 2 raised"
    model = _qwen3(lambda i: -1.0 if i == 1 else 0.0)
    with pytest.raises(ValueError, match=r"^tau\(1\): must be finite and >= 0 \(got -1.0\)"):
        with torch.no_grad():
            model(_ids(n=64))


def test_register_checks_the_spec_and_needs_layer_idx():
    with pytest.raises(ValueError, match=r"^tau\[1\]: must be finite and >= 0"):
        mala_hf.register(tau=[0.0, -1.0])
    with pytest.raises(ValueError, match=r"^tau: must be finite and >= 0"):
        mala_hf.make_attention_function(tau=math.nan)
    fn = mala_hf.make_attention_function(tau=[0.0, 1.0])
    q = torch.randn(1, 2, 16, 32)

    class NoLayerIdx(torch.nn.Module):
        is_causal = True

    with pytest.raises(ValueError, match=r"^tau: a per-layer tau needs a layer index"):
        fn(NoLayerIdx(), q, q, q, None)
    # A number needs no layer index.
    out, _ = mala_hf.make_attention_function(tau=0.0)(NoLayerIdx(), q, q, q, None)
    assert out.shape == (1, 16, 2, 32)

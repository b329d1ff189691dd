"""attn_implementation="mala" in a small Llama (random weights): same logits as SDPA at tau = 0,
training steps at tau = 1, generate() with a DynamicCache, padding through varlen, general masks
falling back to SDPA."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mala  # noqa: E402
import mala.integrations.transformers as mala_hf  # noqa: E402
from conftest import device_params, rel_l2  # noqa: E402


@pytest.fixture
def mala_calls(monkeypatch):
    """Records every mala call made by the integration, so tests can tell mala from the fallback:
    ("dense", Nq, Nk) for mala.attention, ("varlen", total_q, total_k) for mala.attention_varlen."""
    calls = []
    attention, attention_varlen = mala.attention, mala.attention_varlen

    def spy(q, k, v, **kwargs):
        calls.append(("dense", q.shape[1], k.shape[1]))
        return attention(q, k, v, **kwargs)

    def spy_varlen(q, k, v, *args, **kwargs):
        calls.append(("varlen", q.shape[0], k.shape[0]))
        return attention_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(mala, "attention", spy)
    monkeypatch.setattr(mala, "attention_varlen", spy_varlen)
    return calls


def _config(**overrides):
    cfg = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False)
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)  # head_dim = 64


def _models(device, tau, seed=0, **config):
    """A mala model and an sdpa model with identical weights."""
    mala_hf.register(tau=tau)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(_config(**config), attn_implementation="sdpa", dtype=dtype)
    model = transformers.AutoModelForCausalLM.from_config(_config(**config), attn_implementation="mala", dtype=dtype)
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == "mala"
    return model.to(device).eval(), ref.to(device).eval()


def _tokens(device, batch=2, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (batch, n), generator=g).to(device)


def _tolerance(device):
    return 2e-2 if device == "cuda" else 1e-4


@pytest.mark.parametrize("device", device_params())
# head_dim 96 (Phi-style): no CUDA kernel, so attention runs it zero-padded to 128 there.
@pytest.mark.parametrize("config", [{}, dict(hidden_size=384, head_dim=96)], ids=["head_dim64", "head_dim96"])
def test_logits_match_sdpa_at_tau0(device, mala_calls, config):
    model, ref = _models(device, tau=0.0, **config)
    ids = _tokens(device)
    with torch.no_grad():
        logits = model(ids).logits
        ref_logits = ref(ids).logits
    assert mala_calls == [("dense", 200, 200)] * 2, "both layers must run mala"
    assert rel_l2(logits, ref_logits) < _tolerance(device)


@pytest.mark.parametrize("device", device_params())
def test_decode_step_with_cache_matches_sdpa(device, mala_calls):
    """Prefill with a DynamicCache, then one token: Nq = 1 against Nk = n + 1 keys (bottom-right)."""
    model, ref = _models(device, tau=0.0)
    ids = _tokens(device, n=150)
    with torch.no_grad():
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
        ref_out = ref(ids[:, :-1], use_cache=True)
        ref_step = ref(ids[:, -1:], past_key_values=ref_out.past_key_values, use_cache=True).logits
        # Two new tokens at once (1 < Nq < Nk): mala's bottom-right causal rule needs no mask.
        two = model(ids[:, -2:], past_key_values=model(ids[:, :-2], use_cache=True).past_key_values).logits
        ref_two = ref(ids[:, -2:], past_key_values=ref(ids[:, :-2], use_cache=True).past_key_values).logits
    assert rel_l2(step, ref_step) < _tolerance(device)
    assert rel_l2(two, ref_two) < _tolerance(device)
    assert [c[1:] for c in mala_calls] == [(149, 149)] * 2 + [(1, 150)] * 2 + [(148, 148)] * 2 + [(2, 150)] * 2


@pytest.mark.parametrize("device", device_params())
def test_trains_with_tau1(device, mala_calls):
    model, _ = _models(device, tau=1.0)
    model.train()
    ids = _tokens(device, batch=2, n=256, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(ids, labels=ids).loss
        assert torch.isfinite(loss), "loss must stay finite"
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is None or torch.isfinite(p.grad).all()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"memorizing one batch should lower the loss: {losses}"
    assert len(mala_calls) == 12


@pytest.mark.parametrize("device", device_params())
def test_generate_runs_and_matches_sdpa_greedy(device, mala_calls):
    model, ref = _models(device, tau=0.0)
    ids = _tokens(device, batch=2, n=40, seed=2)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        ref_out = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 52)
    assert [c[1:] for c in mala_calls[:4]] == [(40, 40), (40, 40), (1, 41), (1, 41)], mala_calls[:4]
    if device == "cpu":  # float32: no near-ties, greedy decoding is identical
        assert torch.equal(out, ref_out)
    else:  # bfloat16: the first new token at least
        assert torch.equal(out[:, 40], ref_out[:, 40])
    # tau = 1 generates too.
    mala_hf.register(tau=1.0)
    with torch.no_grad():
        assert model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (2, 44)


@pytest.mark.parametrize("device", device_params())
def test_padding_runs_varlen(device, mala_calls):
    """Left padding (and right padding in a full forward) drop the padded tokens and run varlen."""
    model, ref = _models(device, tau=0.0)
    ids = _tokens(device, batch=3, n=64, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :10] = 0  # left padding
    mask[2, 50:] = 0  # right padding
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        ref_logits = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_l2(logits[real], ref_logits[real]) < _tolerance(device)
    assert mala_calls == [("varlen", 64 * 3 - 24, 64 * 3 - 24)] * 2, mala_calls


@pytest.mark.parametrize("device", device_params())
def test_batched_generate_with_left_padding(device, mala_calls):
    model, ref = _models(device, tau=0.0)
    ids = _tokens(device, batch=2, n=30, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        ref_out = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 38)
    assert mala_calls[0] == ("varlen", 60 - 7, 60 - 7) and mala_calls[2] == ("varlen", 2, 62 - 7), mala_calls[:3]
    if device == "cpu":
        assert torch.equal(out, ref_out)
    else:
        assert torch.equal(out[:, 30], ref_out[:, 30])


@pytest.mark.parametrize("device", device_params())
def test_general_mask_falls_back_to_sdpa_or_raises(device, mala_calls):
    """A padding mask with a hole is not one run of real tokens: dense SDPA (or an error)."""
    model, ref = _models(device, tau=0.0)
    ids = _tokens(device, batch=2, n=64, seed=5)
    mask = torch.ones_like(ids)
    mask[0, 20:25] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        ref_logits = ref(ids, attention_mask=mask).logits
    assert rel_l2(logits[mask.bool()], ref_logits[mask.bool()]) < _tolerance(device)
    assert mala_calls == [], "a general mask must not reach mala"
    mala_hf.register(tau=0.0, on_mask="error")
    try:
        with pytest.raises(ValueError, match="attention_mask"):
            with torch.no_grad():
                model(ids, attention_mask=mask)
        with torch.no_grad():  # an all-ones mask needs no mask: mala runs
            model(ids, attention_mask=torch.ones_like(ids))
        assert mala_calls == [("dense", 64, 64)] * 2
    finally:
        mala_hf.register(tau=0.0)

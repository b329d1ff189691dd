"""mala.sdpa: MALA behind torch's SDPA flash backend through torch's flash-attention registry.

torch routes only CUDA calls to that backend, so the CPU tests activate the same kernels at the CPU
dispatch key (mala.sdpa._activate(tau, "CPU")) and call the aten operators directly: that runs
aten's own autograd formulas, and torch.nn.attention.varlen.varlen_attn, through MALA without a
GPU.  The CUDA tests run plain F.scaled_dot_product_attention and a transformers model."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mala
from conftest import HAS_CUDA, local_inputs, rel_l2

attention = pytest.importorskip("torch.nn.attention")
if not hasattr(attention, "register_flash_attention_impl"):
    pytest.skip("torch < 2.11 has no flash-attention registry", allow_module_level=True)

import mala.sdpa  # noqa: E402
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

flash = torch.ops.aten._scaled_dot_product_flash_attention


@pytest.fixture
def on_cpu():
    """Activates MALA's kernels at the CPU key; yields a function that re-activates at another tau."""

    def activate(tau):
        attention.register_flash_attention_impl("MALA-cpu-test", register_fn=lambda: mala.sdpa._activate(tau, "CPU"))
        attention.activate_flash_attention_impl("MALA-cpu-test")

    activate(1.0)
    yield activate
    attention.restore_flash_attention_impl()


def _bhnd(b=2, n=160, hq=4, hkv=2, d=64, seed=0):
    """Local inputs (tau > 0 skips tiles) in SDPA's layout: [B, N, H, d] tensors seen as [B, H, N, d]."""
    q, k, v = local_inputs("cpu", b, n, hq, hkv, d, seed=seed)
    return [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]


def _grads(out, inputs, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def test_import_registers_nothing_and_register_activates_nothing():
    # A fresh interpreter: importing mala (and mala.sdpa) leaves torch's registry as it was.
    code = ("import torch, mala, mala.sdpa; from torch.nn import attention as a; "
            "print(a.list_flash_attention_impls(), a.current_flash_attention_impl())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "MALA" not in out and out.strip().endswith("None"), out
    assert mala.sdpa.register(tau=0.5) == "MALA"
    assert "MALA" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() is None and mala.sdpa.active_tau() is None


def test_mala_sdpa_is_reachable_as_an_attribute_of_mala():
    # The README's route: `import mala` only, then mala.sdpa.register (the lazy attribute, no import of
    # mala.sdpa by name); likewise mala.integrations.
    code = ("import mala; print(mala.sdpa.__name__, callable(mala.sdpa.register), "
            "mala.integrations.__name__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["mala.sdpa", "True", "mala.integrations"], out


def test_a_kernel_wrapped_before_activation_is_the_one_called(monkeypatch):
    # The CUDA tests count calls by wrapping mala.sdpa._sdpa_forward before activating: activation must
    # look each kernel up by its name, not by the __name__ of whatever object the global holds now.
    calls = []
    forward = mala.sdpa._sdpa_forward
    monkeypatch.setattr(mala.sdpa, "_sdpa_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    attention.register_flash_attention_impl("MALA-cpu-wrapped", register_fn=lambda: mala.sdpa._activate(0.0, "CPU"))
    attention.activate_flash_attention_impl("MALA-cpu-wrapped")
    try:
        q, k, v = _bhnd()
        out = flash(q, k, v, 0.0, True)[0]
    finally:
        attention.restore_flash_attention_impl()
    assert calls == [1]
    want = mala.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, tau=0.0)
    assert torch.allclose(out, want)


def test_activation_routes_the_flash_operator_and_restore_undoes_it(on_cpu):
    q, k, v = _bhnd()
    res = flash(q, k, v, 0.0, True)
    assert len(res) == 9 and res[0].grad_fn is not None, "aten's autograd formula must wrap MALA's kernel"
    assert res[1].shape == (2, 4, 160) and res[1].dtype == torch.float32
    assert attention.current_flash_attention_impl() == "MALA-cpu-test" and mala.sdpa.active_tau() == 1.0
    # What mala's SDPA-layout function gives at the same tau, bit for bit, forward and backward.
    want = mala.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, tau=1.0)
    assert torch.equal(res[0], want)
    for got, ref, name in zip(_grads(res[0], (q, k, v)), _grads(want, (q, k, v)), "qkv"):
        assert torch.equal(got, ref), f"d{name}"
    attention.restore_flash_attention_impl()
    assert mala.sdpa.active_tau() is None
    with pytest.raises(NotImplementedError, match="CPU"):  # no CPU kernel of this operator in torch
        flash(q, k, v, 0.0, True)


def test_tau_is_chosen_per_activation(on_cpu):
    q, k, v = _bhnd(n=400, seed=2)  # long enough that tau = 4 skips tiles of 128 keys
    on_cpu(0.0)
    dense = flash(q, k, v, 0.0, True)[0]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_l2(dense, ref) < 1e-5
    for got, want, name in zip(_grads(dense, (q, k, v)), _grads(ref, (q, k, v)), "qkv"):
        assert rel_l2(got, want) < 1e-5, f"d{name}"
    on_cpu(4.0)  # activating again replaces the previous kernels (no "already registered")
    sparse = flash(q, k, v, 0.0, True)[0]
    assert mala.sdpa.active_tau() == 4.0
    assert torch.equal(sparse, mala.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, tau=4.0))
    assert rel_l2(sparse, dense) > 1e-4, "tau = 4 skipped nothing: the test cannot tell taus apart"
    assert not torch.equal(flash(q, k, v, 0.0, False)[0], sparse), "is_causal must reach MALA"


def test_output_layout_follows_the_query_like_torchs_meta(on_cpu):
    # A [B, H, N, d]-contiguous query: torch's meta function says empty_like(query), so MALA's
    # [B, N, H, d] result is copied to that layout (compiled graphs assume it).
    q, k, v = (t.detach().contiguous().requires_grad_() for t in _bhnd(n=64))
    out = flash(q, k, v, 0.0, True)[0]
    assert out.stride() == q.stride()
    dq, dk, dv = _grads(out, (q, k, v))
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == v.stride()
    assert torch.equal(out, mala.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    # The usual transposed view is returned as MALA wrote it (no copy).
    qt, kt, vt = _bhnd(n=64)
    assert flash(qt, kt, vt, 0.0, True)[0].stride() == qt.stride()


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attn_runs_mala(on_cpu, causal):
    lens = [37, 150, 1]
    cu = torch.tensor([0, 37, 187, 188], dtype=torch.int32)
    q, k, v = (t[0].detach().requires_grad_() for t in local_inputs("cpu", 1, sum(lens), 4, 2, 64, seed=3))
    window = (-1, 0) if causal else (-1, -1)  # varlen_attn's spelling of causal
    out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window)
    want = mala.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), tau=1.0, causal=causal)
    assert torch.equal(out, want)
    for got, ref, name in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), "qkv"):
        assert torch.equal(got, ref), f"d{name}"


def test_what_mala_lacks_raises_naming_the_argument(on_cpu):
    q, k, v = _bhnd(n=32)
    with pytest.raises(NotImplementedError, match=r"^dropout_p: MALA .* \(got 0.1\).*sdpa_kernel"):
        flash(q, k, v, 0.1, True)
    with pytest.raises(NotImplementedError, match=r"^return_debug_mask"):
        flash(q, k, v, 0.0, True, True)
    with pytest.raises(ValueError, match=r"^is_causal: SDPA aligns the causal mask top-left"):
        flash(q, k[:, :, :16], v[:, :, :16], 0.0, True)
    cu = torch.tensor([0, 32], dtype=torch.int32)
    qv, kv, vv = (t[0].transpose(0, 1) for t in (q, k, v))
    with pytest.raises(NotImplementedError, match=r"^window_size: .*\(got \(8, 0\)\)"):
        varlen_attn(qv, kv, vv, cu, cu, 32, 32, window_size=(8, 0))
    ops = torch.ops.aten
    with pytest.raises(NotImplementedError, match=r"^seqused_k"):
        ops._flash_attention_forward(qv, kv, vv, cu, cu, 32, 32, 0.0, True, False, seqused_k=cu[1:])
    with pytest.raises(NotImplementedError, match=r"^alibi_slopes"):
        ops._flash_attention_forward(qv, kv, vv, cu, cu, 32, 32, 0.0, True, False, alibi_slopes=torch.zeros(4))
    with pytest.raises(NotImplementedError, match=r"^dropout_p"):
        ops._flash_attention_forward(qv, kv, vv, cu, cu, 32, 32, 0.5, True, False)


def test_register_checks_its_arguments():
    with pytest.raises(ValueError, match=r"^tau: must be finite and >= 0"):
        mala.sdpa.register(tau=-1.0)
    with pytest.raises(TypeError, match=r"^tau: must be a number"):
        mala.sdpa.register(tau=None)
    with pytest.raises(ValueError, match=r"^name: must be a non-empty string"):
        mala.sdpa.register(name="")


def test_cuda_activation_leaves_cpu_calls_to_torch():
    """Activated as it ships (the CUDA key), MALA never sees a CPU call: SDPA on the CPU, a mask and
    dropout included, is torch's own, exactly as before activation."""
    q, k, v = (t.detach() for t in _bhnd(n=48, hkv=4))
    mask = torch.rand(48, 48, generator=torch.Generator().manual_seed(0)) > 0.3
    before = (F.scaled_dot_product_attention(q, k, v, is_causal=True),
              F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    mala.sdpa.register(tau=1.0)
    attention.activate_flash_attention_impl("MALA")
    try:
        assert mala.sdpa.active_tau() == 1.0
        after = (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None


# ---- CUDA: code that calls SDPA, unchanged ------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")


@pytest.fixture
def on_cuda():
    """Activates MALA at the CUDA key.  cuDNN is left out of SDPA's backends: recent torch puts it ahead
    of flash on sm90/sm100 with a new cuDNN (docs/python.md), and these tests check MALA, not that choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def activate(tau):
        attention.activate_flash_attention_impl(mala.sdpa.register(tau=tau))

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield activate
    attention.restore_flash_attention_impl()


@needs_cuda
@pytest.mark.parametrize("tau", [0.0, 1.0])
@pytest.mark.parametrize("head_dim", [64, 96])  # 96: no CUDA kernel, run zero-padded to 128
def test_cuda_sdpa_equals_mala(on_cuda, monkeypatch, tau, head_dim):
    calls = []
    forward = mala.sdpa._sdpa_forward
    monkeypatch.setattr(mala.sdpa, "_sdpa_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    on_cuda(tau)
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in local_inputs("cuda", 2, 1000, 8, 2, head_dim))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert calls, "SDPA did not reach MALA's kernel"
    want = mala.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, tau=tau)
    assert torch.equal(out, want)
    # The backward through aten's formula has no forward tile mask: the same skips up to rounding at
    # the threshold, and atomics in dQ, so a bf16 tolerance.
    for got, ref, name in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), "qkv"):
        assert rel_l2(got, ref) < 1e-2, f"d{name}"


@needs_cuda
def test_cuda_transformers_sdpa_model_equals_mala_integration(on_cuda, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import mala.integrations.transformers as mala_hf

    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_dropout=0.0,
                                   max_position_embeddings=2048, tie_word_embeddings=False)
    mala_hf.register(tau=1.0)
    torch.manual_seed(0)
    # One config object each: from_config sets config._attn_implementation on the object it is given,
    # and a model reads it at every forward, so a shared config would turn the sdpa model into MALA's.
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="mala", dtype=torch.bfloat16)
    ref.load_state_dict(sdpa.state_dict())
    sdpa, ref = sdpa.cuda(), ref.cuda()
    ids = torch.randint(0, 512, (2, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    calls = []
    forward = mala.sdpa._sdpa_forward
    monkeypatch.setattr(mala.sdpa, "_sdpa_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    on_cuda(1.0)
    seen = []
    sdpa_fn = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append(dict(shape=tuple(q.shape), kv=tuple(k.shape), mask=attn_mask is not None, causal=is_causal,
                         gqa=enable_gqa, dropout=dropout_p, dtype=str(q.dtype),
                         backend=int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                             enable_gqa=enable_gqa))))
        return sdpa_fn(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                       enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    loss = sdpa(ids, labels=ids).loss
    assert len(calls) == 2, f"both layers' SDPA calls must reach MALA; torch's calls (backend 1 = flash): {seen}"
    loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-3 * abs(ref_loss.item())
    with torch.no_grad():
        assert torch.equal(sdpa(ids).logits, ref(ids).logits)
    for (name, p), r in zip(sdpa.named_parameters(), ref.parameters()):
        if p.grad is not None:
            assert rel_l2(p.grad, r.grad) < 2e-2, name

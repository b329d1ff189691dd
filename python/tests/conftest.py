"""Shared helpers for the mala Python tests.

Every test takes a `device` parameter: "cuda" (bfloat16; skipped without a GPU) and, where the CPU
implementation is fast enough, "cpu" (float32).  Without torch or without the built package the
whole directory is skipped, so CI (no torch) is unaffected.
"""

import math

import pytest

torch = pytest.importorskip("torch")
mala = pytest.importorskip("mala")

HAS_CUDA = torch.cuda.is_available()


def device_params(cpu=True):
    params = [pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU"))]
    if cpu:
        params.append("cpu")
    return params


def dtype_for(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def rand(shape, device, dtype, scale=1.0, generator=None):
    return (torch.randn(shape, device=device, dtype=torch.float32, generator=generator) * scale).to(dtype)


def reference_attention(q, k, v, causal=True, softmax_scale=None, upcast=True):
    """Dense attention with bottom-right causal alignment and GQA, in float32 (upcast) or in the inputs'
    precision (upcast=False: the 'plain PyTorch in low precision' error yardstick).  Returns (out, lse);
    rows that see no key give zeros and lse = -inf.  Differentiable."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    nq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    nk, hkv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if causal:
        rows = torch.arange(nq, device=q.device).view(-1, 1)
        cols = torch.arange(nk, device=q.device).view(1, -1)
        scores = scores.masked_fill(cols > rows + nk - nq, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1).clamp(min=-1e30))
    p = torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros_like(p))
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return (out if upcast else out.to(dtype)), lse


def max_err(x, ref):
    return (x.float() - ref.float()).abs().max().item()


def rel_l2(x, ref):
    ref = ref.float()
    return ((x.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def assert_close_to_reference(x, ref_fp32, ref_lowp, name, rel_l2_limit=1e-2):
    """The FlashAttention habit: err(x) <= 2 * err(low-precision reference) + eps, plus an absolute
    relative-L2 bound."""
    err, base = max_err(x, ref_fp32), max_err(ref_lowp, ref_fp32)
    eps = 1e-5 + 1e-3 * ref_fp32.float().abs().max().item()
    assert err <= 2 * base + eps, f"{name}: max error {err:.3g} > 2 * {base:.3g} (low-precision ref) + {eps:.2g}"
    assert rel_l2(x, ref_fp32) < rel_l2_limit, f"{name}: relative L2 error {rel_l2(x, ref_fp32):.3g}"


def local_inputs(device, batch, n, heads_q, heads_kv, head_dim, sharpness=2.0, noise=1.0, seed=0, dtype=None):
    """Inputs with local (near-diagonal) attention, so that tau > 0 skips whole tiles: half of each
    q/k row is a shared slowly rotating positional code (score falls with |i - j|, steeper with
    `sharpness`), the other half noise; v ~ N(0, 1)."""
    dtype = dtype or dtype_for(device)
    g = torch.Generator(device=device).manual_seed(seed)
    n_freq = head_dim // 4
    omega = math.pi * torch.arange(1, n_freq + 1, device=device) / (n_freq * n)
    phase = torch.arange(n, device=device).float()[:, None] * omega[None, :]
    code = torch.cat([phase.cos(), phase.sin()], dim=-1)  # [n, head_dim / 2]
    amplitude = math.sqrt(sharpness * math.sqrt(head_dim))

    def make(heads):
        t = torch.randn((batch, n, heads, head_dim), generator=g, device=device) * noise
        t[..., : head_dim // 2] = amplitude * code[None, :, None, :]
        return t.to(dtype)

    q, k = make(heads_q), make(heads_kv)
    v = torch.randn((batch, n, heads_kv, head_dim), generator=g, device=device).to(dtype)
    return q, k, v

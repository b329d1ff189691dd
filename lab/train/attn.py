"""Attention backends of the study, registered in transformers' public AttentionInterface.

  "mala"        the library's integration (mala.integrations.transformers.register(tau)): the MALA arm
  "sdpa"        transformers' own SDPA: the dense arm
  "sdpa_ea"     torch's SDPA held to a second exact backend (the memory-efficient kernel on CUDA, the
                math one on the CPU): the dense_ea arm, how far two exact attentions' runs drift apart
  "mala_stats"  mala.attention(tau, return_stats=True) per layer, recording the kernels' realized work
                (forward and, once backward has run, backward slots and tile decisions) in RECORD;
                used to measure either arm's held-out batch with MALA tau = 1
  "sdpa_fp32"   SDPA in float32 (math kernel) inside the bf16 model: the reference that isolates an
                attention's own error in analyze.py grads
  "timed"       whichever of the above TIMED["inner"] names, with CUDA events around each layer's
                attention forward and backward (the backward's span runs from the output's gradient
                to the query's)

Every one of them takes plain causal attention only (the mask builder returns None for it).
"""

from __future__ import annotations

import torch

import mala
import mala.integrations.transformers as mala_hf

RECORD = {"tau": 1.0, "layers": {}}
TIMED = {"inner": "sdpa", "events": []}


def _plain_causal(attention_mask):
    if attention_mask is not None:
        raise ValueError("attention_mask: the study's attention takes plain causal attention only")


def _stats_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _plain_causal(attention_mask)
    out, stats = mala.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                tau=RECORD["tau"], causal=True, softmax_scale=scaling, return_stats=True)
    RECORD["layers"][module.layer_idx] = stats
    return out, None


def _second_backend():
    from torch.nn.attention import SDPBackend

    return SDPBackend.EFFICIENT_ATTENTION if torch.cuda.is_available() else SDPBackend.MATH


def _sdpa_ea_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA on one exact backend other than the default's; grouped key / value heads are
    repeated here, since the memory-efficient kernel takes no enable_gqa."""
    from torch.nn.attention import sdpa_kernel

    _plain_causal(attention_mask)
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    with sdpa_kernel([_second_backend()]):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_fp32_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA in float32 on SDPA's math kernel, whatever the autocast: the inputs upcast (exact),
    the output cast back to the inputs' dtype.  Under the training's bf16 autocast every other op
    rounds as in training, so a gradient's distance from this one is its attention's own error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _plain_causal(attention_mask)
    dt = query.dtype
    with torch.autocast(query.device.type, enabled=False), sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(), is_causal=True,
                                                               scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.to(dt).transpose(1, 2).contiguous(), None


def _timed_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[TIMED["inner"]]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    out, w = inner(module, query, key, value, attention_mask, **kwargs)
    ev[1].record()
    if out.requires_grad:
        out.register_hook(lambda g: (ev[2].record(), g)[1])
        query.register_hook(lambda g: (ev[3].record(), g)[1])
        TIMED["events"].append(ev)
    else:
        TIMED["events"].append(ev[:2])
    return out, w


def register(tau: float = 1.0):
    """Registers "mala" (the integration, at tau), "mala_stats", "sdpa_ea", "sdpa_fp32" and "timed"."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    mala_hf.register(tau=tau)
    RECORD["tau"] = float(tau)
    AttentionInterface.register("mala_stats", _stats_attention)
    AttentionInterface.register("sdpa_ea", _sdpa_ea_attention)
    AttentionInterface.register("sdpa_fp32", _sdpa_fp32_attention)
    AttentionInterface.register("timed", _timed_attention)
    # The integration's mask builder: None for plain causal attention.
    AttentionMaskInterface.register("mala_stats", ALL_MASK_ATTENTION_FUNCTIONS["mala"])
    AttentionMaskInterface.register("sdpa_ea", ALL_MASK_ATTENTION_FUNCTIONS["mala"])
    AttentionMaskInterface.register("sdpa_fp32", ALL_MASK_ATTENTION_FUNCTIONS["mala"])
    AttentionMaskInterface.register("timed", ALL_MASK_ATTENTION_FUNCTIONS["mala"])


def set_attention(model, name: str):
    """Switches every layer of the model to a registered attention (transformers reads
    config._attn_implementation on each forward)."""
    model.set_attn_implementation(name)


def take_timings():
    """(forward ms, backward ms) summed over the layers recorded since the last call."""
    torch.cuda.synchronize()
    f = b = 0.0
    for ev in TIMED["events"]:
        f += ev[0].elapsed_time(ev[1])
        if len(ev) == 4:
            b += ev[2].elapsed_time(ev[3])
    TIMED["events"] = []
    return f, b


def take_stats():
    """Per layer (in order): mean forward / backward slots per query and retained tile fractions
    from the kernels' counters (backward ones None when no backward ran)."""
    out = []
    for li in sorted(RECORD["layers"]):
        st = RECORD["layers"][li]
        out.append({"fwd_slots": st.mean_fwd_slots, "bwd_slots": st.mean_bwd_slots,
                    "fwd_retained": st.fwd_retained_fraction, "bwd_retained": st.bwd_retained_fraction})
    RECORD["layers"] = {}
    return out

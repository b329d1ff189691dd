"""MALA as a transformers attention backend (transformers 5.x).

    import mala.integrations.transformers as mala_hf
    mala_hf.register(tau=1.0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mala")

register() adds two entries under the same name:
  - AttentionInterface["mala"]: the attention function below;
  - AttentionMaskInterface["mala"]: a mask builder that returns None (no mask) exactly when plain
    causal attention aligned bottom-right is the right answer: no padding, no sliding window or
    packed sequences, and the queries are the last q_length of kv_length keys (training, prefill,
    generate() with a DynamicCache).  Otherwise it returns transformers' own 4D boolean SDPA mask.
With no mask the attention function runs mala.attention (Nq != Nk during generation is bottom-right
causal, as the cache requires).  With a mask (padding, StaticCache, sliding windows, packing, or a
4D mask passed by the caller) it falls back to dense SDPA with that mask (tau does not apply),
or raises ValueError when register(on_mask="error").
"""

import torch

import mala

_DEFAULT_NAME = "mala"


def _plain_causal_mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                               attention_mask=None, **kwargs):
    """AttentionMaskInterface entry: None when bottom-right causal needs no mask, else the SDPA mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    from transformers.utils.import_utils import is_tracing

    plain = mask_function is None or mask_function is causal_mask_function
    if plain and isinstance(q_offset, int) and isinstance(kv_offset, int) and isinstance(kv_length, int):
        plain = kv_offset == 0 and q_offset + q_length == kv_length
    else:
        plain = False
    if plain and attention_mask is not None:
        padding = attention_mask[:, -kv_length:] if attention_mask.shape[-1] >= kv_length else attention_mask
        # A data-dependent check: only outside tracing (compiled models with a padding mask fall back).
        plain = (padding.shape[-1] == kv_length and not is_tracing(padding) and bool(padding.all()))
    if plain:
        return None
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)


def make_attention_function(tau=1.0, on_mask="sdpa"):
    """The function registered in transformers' AttentionInterface (see register)."""
    if on_mask not in ("sdpa", "error"):
        raise ValueError(f"on_mask: must be 'sdpa' or 'error' (got {on_mask!r})")
    tau = float(tau)
    if not tau >= 0.0:
        raise ValueError(f"tau: must be >= 0 (got {tau})")

    def mala_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                               **kwargs):
        # query [B, Hq, Nq, d], key/value [B, Hkv, Nk, d] (transformers layout); returns [B, Nq, Hq, d].
        if dropout:
            raise ValueError(f"dropout: mala has no attention dropout (got {dropout}); set attention_dropout=0")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if attention_mask is not None or kwargs.get("position_bias") is not None:
            if on_mask == "error":
                raise ValueError(
                    "attention_mask: mala runs plain (bottom-right) causal attention only; this call needs a mask "
                    "(padding, a static cache, sliding window or packed sequences). Register with on_mask='sdpa' "
                    "to fall back to dense SDPA for such calls.")
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
        out = mala.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), tau=tau,
                             causal=causal, softmax_scale=scaling)
        return out, None

    return mala_attention_forward


def register(tau=1.0, name=_DEFAULT_NAME, on_mask="sdpa"):
    """Registers MALA as attn_implementation=`name` ("mala") for transformers models.

    tau: the MALA tolerance for every attention layer (0 = exact dense attention).
    on_mask: what to do when a call needs an explicit mask: "sdpa" (dense SDPA fallback) or "error".
    Calling it again replaces the registration (e.g. to change tau).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, make_attention_function(tau, on_mask))
    AttentionMaskInterface.register(name, _plain_causal_mask_builder)
    return name

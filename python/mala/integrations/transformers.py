"""MALA as a transformers attention backend (transformers 5.x).

    import mala.integrations.transformers as mala_hf
    mala_hf.register(tau=1.0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mala")

register() adds two entries under the same name:
  - AttentionInterface["mala"]: the attention function below;
  - AttentionMaskInterface["mala"]: the mask builder below, which tells the attention function
    which of three cases a forward pass is:
      None        plain causal attention aligned bottom-right is the right answer: no padding, no
                  sliding window or packed sequences, and the queries are the last q_length of the
                  kv_length keys (training, prefill, generate() with a DynamicCache)
                  -> mala.attention (Nq != Nk during generation is bottom-right causal, as a cache needs);
      2D bool     the same but with padding, each row's real tokens one contiguous run (left padding,
                  or right padding when Nq = Nk) -> the padded tokens are dropped and the rest runs
                  through mala.attention_varlen (padded query rows get zeros);
      4D bool     anything else (holes in the padding, StaticCache, sliding windows, packed
                  sequences, a 4D mask from the caller, or any padding while tracing/compiling):
                  transformers' own SDPA mask -> dense SDPA fallback (tau does not apply), or
                  ValueError when register(on_mask="error").
"""

import torch
import torch.nn.functional as F

import mala
from mala.api import check_tau_spec, layer_tau

_DEFAULT_NAME = "mala"


def _unpaddable(padding, q_length, kv_length):
    """True when every row's kept keys are one contiguous run that the row's kept queries (the last
    q_length positions) end together with, so that dropping the padding keeps bottom-right causality."""
    kept = padding.to(torch.int32)
    runs = kept[:, 0] + (kept.diff(dim=1) == 1).sum(dim=1)
    if not bool((runs <= 1).all()):
        return False
    return q_length == kv_length or bool(padding[:, -1].all())


def _mask_builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """AttentionMaskInterface entry: None, a 2D padding mask, or the 4D SDPA mask (module docstring)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    from transformers.utils.import_utils import is_tracing

    plain = (mask_function is None or mask_function is causal_mask_function) and all(
        isinstance(x, int) for x in (q_offset, kv_offset, kv_length))
    plain = plain and kv_offset == 0 and q_offset + q_length == kv_length
    if plain and attention_mask is None:
        return None
    if plain and attention_mask.shape[-1] >= kv_length and not is_tracing(attention_mask):
        padding = attention_mask[:, -kv_length:].to(torch.bool)
        if bool(padding.all()):
            return None
        if _unpaddable(padding, q_length, kv_length):
            return padding
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)


def _padded_attention(query, key, value, padding, tau, causal, scaling):
    """Drops the padded tokens, runs mala.attention_varlen, scatters back ([B, Nq, Hq, d], zeros at
    padded query rows).  padding: [B, Nk] bool, True for real tokens; queries are the last Nq keys."""
    batch, heads_q, seqlen_q, head_dim = query.shape
    heads_kv, seqlen_k = key.shape[1], key.shape[2]
    keep_k = padding
    keep_q = padding[:, -seqlen_q:]
    rows_q = keep_q.reshape(-1).nonzero().squeeze(1)
    rows_k = keep_k.reshape(-1).nonzero().squeeze(1)
    q = query.transpose(1, 2).reshape(batch * seqlen_q, heads_q, head_dim).index_select(0, rows_q)
    k = key.transpose(1, 2).reshape(batch * seqlen_k, heads_kv, head_dim).index_select(0, rows_k)
    v = value.transpose(1, 2).reshape(batch * seqlen_k, heads_kv, head_dim).index_select(0, rows_k)
    len_q = keep_q.sum(dim=1, dtype=torch.int32)
    len_k = keep_k.sum(dim=1, dtype=torch.int32)
    cu_q = F.pad(len_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = F.pad(len_k.cumsum(0, dtype=torch.int32), (1, 0))
    max_q, max_k = int(len_q.max()), int(len_k.max())
    out = query.new_zeros((batch * seqlen_q, heads_q, head_dim))
    if rows_q.numel() and max_k > 0:
        packed = mala.attention_varlen(q, k, v, cu_q, cu_k, max(max_q, 1), max_k, tau=tau, causal=causal,
                                       softmax_scale=scaling, check_inputs=False)
        out = out.index_copy(0, rows_q, packed)
    return out.view(batch, seqlen_q, heads_q, head_dim)


def make_attention_function(tau=1.0, on_mask="sdpa"):
    """The function registered in transformers' AttentionInterface (see register)."""
    if on_mask not in ("sdpa", "error"):
        raise ValueError(f"on_mask: must be 'sdpa' or 'error' (got {on_mask!r})")
    tau_spec = check_tau_spec(tau)  # mala.attention's check and message, for every value known now

    def mala_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                               **kwargs):
        # query [B, Hq, Nq, d], key/value [B, Hkv, Nk, d] (transformers layout); returns [B, Nq, Hq, d].
        if dropout:
            raise ValueError(f"dropout: mala has no attention dropout (got {dropout}); set attention_dropout=0")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # Resolved at each call, so a list too short for the model names the first layer it lacks.
        tau = layer_tau(tau_spec, getattr(module, "layer_idx", None))
        if kwargs.get("position_bias") is None:
            if attention_mask is None:
                out = mala.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), tau=tau,
                                     causal=causal, softmax_scale=scaling)
                return out, None
            if attention_mask.dim() == 2 and attention_mask.dtype == torch.bool \
                    and attention_mask.shape == (key.shape[0], key.shape[2]):
                return _padded_attention(query, key, value, attention_mask, tau, causal, scaling), None
        if on_mask == "error":
            raise ValueError(
                "attention_mask: mala runs causal attention over contiguous runs of real tokens only; this call "
                "needs a general mask (padding with holes, a static cache, sliding window, packed sequences or "
                "a 4D mask). Register with on_mask='sdpa' to fall back to dense SDPA for such calls.")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)

    return mala_attention_forward


def register(tau=1.0, name=_DEFAULT_NAME, on_mask="sdpa"):
    """Registers MALA as attn_implementation=`name` ("mala") for transformers models.

    tau: the MALA tolerance (0 = exact dense attention): a number for every attention layer, or a
         per-layer spec indexed by module.layer_idx (0-based): a list/tuple with one entry per layer, a
         dict {layer_idx: tau, "default": tau}, or a callable tau(layer_idx) -> float (mala.layer_tau).
         A list, tuple or dict is checked here; a callable's values, and a list too short for the
         model, raise at the first forward of the layer concerned.
    on_mask: what to do when a call needs a general mask: "sdpa" (dense SDPA fallback) or "error".
    Calling it again replaces the registration (e.g. to change tau).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, make_attention_function(tau, on_mask))
    AttentionMaskInterface.register(name, _mask_builder)
    return name

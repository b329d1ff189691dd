"""FlashAttention-2 call signatures over MALA, for code written against `flash_attn`.

    from mala.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

and the packed forms, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
flash_attn_varlen_qkvpacked_func and flash_attn_varlen_kvpacked_func: qkv [B, N, 3, H, d] (varlen
[total, 3, H, d]), kv [B, Nk, 2, Hkv, d] (varlen [total_k, 2, Hkv, d]).  q, k and v are views of
the packed tensor (no copy; the kernels take the strides), and the gradient arrives as one tensor of
the packed shape.

The positional and keyword arguments are flash_attn's (2.x), so switching is an import change; the
defaults are flash_attn's too (causal=False), plus one keyword-only argument, `tau` (default 1.0,
MALA's tolerance; tau=0.0 is exact dense attention).  Arguments MALA does not implement (dropout,
sliding windows, softcapping, ALiBi, rotary embedding inside the call, cache_batch_idx,
cache_leftpad) raise NotImplementedError naming the argument when set to anything but their
"off" value, rather than being ignored.  `deterministic=True` gives bit-identical gradients from run
to run (CUDA: sm_90, an error elsewhere; mala.attention's `deterministic`).

Like flash_attn, these never synchronize with the GPU to validate cu_seqlens / cache_seqlens /
block_table (mala.attention_varlen does by default, outside CUDA-graph capture;
mala.attention_with_kvcache does not either); pass check_inputs=True to get those checks.  Without
them, out-of-range values are undefined behaviour, as in flash_attn (the output is meaningless and
the kernels may read out of bounds).

flash_attn_with_kvcache also takes a keyword-only `split_rule` ("seeded", the default, or "per_split"),
passed to mala.attention_with_kvcache (docs/python.md).

Returns follow flash_attn: `out`, or `(out, softmax_lse, None)` with return_attn_probs=True (MALA
never materializes the probabilities); flash_attn_with_kvcache returns `(out, softmax_lse)` with
return_softmax_lse=True.  softmax_lse is float32 [B, Hq, Nq] ([Hq, total_q] for varlen).
"""

from typing import Optional, Tuple

import torch

from .api import attention, attention_varlen, attention_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]


def _common_checks(dropout_p, window_size, softcap, alibi_slopes):
    if float(dropout_p) != 0.0:
        raise NotImplementedError(f"dropout_p: MALA has no attention dropout (got {dropout_p}; only 0.0)")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size: no sliding window in MALA (got {tuple(window_size)}; only (-1, -1))")
    if float(softcap) != 0.0:
        raise NotImplementedError(f"softcap: no logit softcapping in MALA (got {softcap}; only 0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: not supported by MALA")


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False, *, tau: float = 1.0):
    """flash_attn.flash_attn_func: q [B, Nq, Hq, d], k/v [B, Nk, Hkv, d] -> out [B, Nq, Hq, d]."""
    _common_checks(dropout_p, window_size, softcap, alibi_slopes)
    res = attention(q, k, v, tau=tau, causal=causal, softmax_scale=softmax_scale, return_lse=return_attn_probs,
                    deterministic=deterministic)
    return (*res, None) if return_attn_probs else res


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           deterministic: bool = False, return_attn_probs: bool = False,
                           block_table: Optional[torch.Tensor] = None, *, tau: float = 1.0,
                           check_inputs: bool = False):
    """flash_attn.flash_attn_varlen_func: packed q [total_q, Hq, d], k/v [total_k, Hkv, d]; with
    block_table int32 [batch, max_blocks], paged k/v [num_blocks, page_size, Hkv, d] (any page_size;
    flash_attn 2's kernels take multiples of 256), differentiable unlike flash_attn's."""
    _common_checks(dropout_p, window_size, softcap, alibi_slopes)
    res = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tau=tau, causal=causal,
                           softmax_scale=softmax_scale, return_lse=return_attn_probs, check_inputs=check_inputs,
                           deterministic=deterministic, block_table=block_table)
    return (*res, None) if return_attn_probs else res


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes=None, num_splits: int = 0,
                            return_softmax_lse: bool = False, *, tau: float = 1.0, check_inputs: bool = False,
                            split_rule: str = "seeded"):
    """flash_attn.flash_attn_with_kvcache.  k/v, when given, are appended in place at cache_seqlens
    like flash_attn does.  cache_seqlens None means every cache is full (then k/v cannot be given).
    split_rule ("seeded" or "per_split") is mala.attention_with_kvcache's."""
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("rotary_cos/rotary_sin: apply the rotary embedding before the call")
    if cache_batch_idx is not None:
        raise NotImplementedError("cache_batch_idx: not supported by MALA (index the cache instead)")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad: not supported by MALA")
    _common_checks(0.0, window_size, softcap, alibi_slopes)
    if cache_seqlens is None:
        if k is not None or v is not None:
            raise ValueError("cache_seqlens: required when k/v are appended (None means the caches are full)")
        cache_seqlens = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table, tau=tau,
                                  causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                                  return_lse=return_softmax_lse, check_inputs=check_inputs, split_rule=split_rule)


def _unpack(t, name: str, layout: str, dim: int, parts: int):
    """The views q, k, v (or k, v) of a packed tensor; its shape checked against `layout`."""
    rank = layout.count(",") + 1
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.shape[dim] != parts:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: must have shape {layout} (got {got})")
    # unbind: autograd stacks the parts' gradients into one tensor of the packed shape.
    return t.unbind(dim=dim)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False, *,
                              tau: float = 1.0):
    """flash_attn.flash_attn_qkvpacked_func: qkv [B, N, 3, H, d] -> out [B, N, H, d] (one head count for
    q, k and v, as in flash_attn; GQA: flash_attn_kvpacked_func)."""
    q, k, v = _unpack(qkv, "qkv", "[batch, seqlen, 3, heads, head_dim]", 2, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, tau=tau)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                             deterministic: bool = False, return_attn_probs: bool = False, *, tau: float = 1.0):
    """flash_attn.flash_attn_kvpacked_func: q [B, Nq, Hq, d], kv [B, Nk, 2, Hkv, d] -> out [B, Nq, Hq, d]."""
    k, v = _unpack(kv, "kv", "[batch, seqlen_k, 2, heads_kv, head_dim]", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, tau=tau)


def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                     causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, tau: float = 1.0,
                                     check_inputs: bool = False):
    """flash_attn.flash_attn_varlen_qkvpacked_func: qkv [total, 3, H, d] -> out [total, H, d]."""
    q, k, v = _unpack(qkv, "qkv", "[total, 3, heads, head_dim]", 1, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  tau=tau, check_inputs=check_inputs)


def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1),
                                    softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                                    return_attn_probs: bool = False, *, tau: float = 1.0,
                                    check_inputs: bool = False):
    """flash_attn.flash_attn_varlen_kvpacked_func: q [total_q, Hq, d], kv [total_k, 2, Hkv, d] -> out
    [total_q, Hq, d]."""
    k, v = _unpack(kv, "kv", "[total_k, 2, heads_kv, head_dim]", 1, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, tau=tau, check_inputs=check_inputs)

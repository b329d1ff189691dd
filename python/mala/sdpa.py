"""MALA as a provider behind torch's SDPA flash backend (torch >= 2.11's flash-attention registry).

    import mala.sdpa, torch
    mala.sdpa.register(tau=1.0)                                    # nothing changes yet
    torch.nn.attention.activate_flash_attention_impl("MALA")       # now SDPA's flash backend is MALA
    ...  F.scaled_dot_product_attention(q, k, v, is_causal=True)  # unchanged code runs mala's kernels
    torch.nn.attention.restore_flash_attention_impl()             # torch's own flash again

This is the route FlashAttention-4 takes (torch/nn/attention/_fa4.py): activation registers Python
kernels at the CUDA dispatch key for the four aten operators of the flash backend,
  _scaled_dot_product_flash_attention (+ _backward)  what F.scaled_dot_product_attention calls when
                                                     it picks the flash backend ([B, H, N, d]);
  _flash_attention_forward (+ _backward)             what torch.nn.attention.varlen.varlen_attn
                                                     calls ([total, H, d] with cu_seq offsets);
and aten's own autograd formulas connect each forward to its backward.  torch still chooses the
backend: only calls that torch's flash backend accepts reach MALA (CUDA, float16/bfloat16, no
attn_mask, is_causal only with Nq == Nk, head_dim <= 256); every other call (a mask, float32, the
CPU, ...) runs on torch's other backends exactly as before, dense, where tau does not apply.  Of
what reaches MALA, what it lacks raises NotImplementedError naming the argument (dropout_p > 0,
return_debug_mask, a sliding window, alibi_slopes, seqused_k) instead of running something else
under MALA's name.

The backward receives what aten's formula saves (out and lse), not the forward's tile mask, so it
re-derives its skips from lse (the decisions of mala.attention's backward up to rounding at the
threshold, docs/spec.md "Nesting"); with the mask, mala.attention's backward is faster when few
tiles are kept.  Nothing is activated on import.
"""

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from . import api
from .api import _cuda_pad_target, _scale_arg, _tau_arg

DEFAULT_NAME = "MALA"

# The aten operators of torch's flash backend that activation replaces (those FA4 replaces).
OPERATORS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
             "_flash_attention_forward", "_flash_attention_backward")


def _registry():
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        raise RuntimeError(f"mala.sdpa: needs torch >= 2.11 (torch.nn.attention.register_flash_attention_impl); "
                           f"this is torch {torch.__version__}. mala.scaled_dot_product_attention works on any torch")
    return attention


def register(tau: float = 1.0, name: str = DEFAULT_NAME) -> str:
    """Registers MALA at `tau` as torch's flash-attention implementation `name` ("MALA"); activates
    nothing.  Then torch.nn.attention.activate_flash_attention_impl(name) puts it behind SDPA's flash
    backend and varlen_attn, and torch.nn.attention.restore_flash_attention_impl() takes it out.

    tau: MALA's tolerance for every call while active (0 = exact dense attention); checked as
         mala.attention checks it.  Registering the same name again replaces its tau from the next
         activation on; register other names for other taus (e.g. "MALA-dense" at tau=0) and switch
         between them by activating.
    Returns name.
    """
    tau = _tau_arg(tau)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string (got {name!r})")
    _registry().register_flash_attention_impl(name, register_fn=lambda: _activate(tau))
    return name


def active_tau() -> Optional[float]:
    """The tau of the MALA provider active now, or None when none is (torch's flash or another one)."""
    return None if _ACTIVE is None else _ACTIVE.tau


@dataclass
class _Handle:
    """What torch's registry keeps while MALA is active; remove() (called by the registry when
    another implementation is activated or restore_flash_attention_impl runs) unregisters the kernels."""

    library: Optional[torch.library.Library]
    tau: float

    def remove(self) -> None:
        global _ACTIVE
        if self.library is not None:
            # Explicitly, not when the Library is collected: a later activation of the same operators
            # must find them free.
            self.library._destroy()
            self.library = None
        if _ACTIVE is self:
            _ACTIVE = None


_ACTIVE: Optional[_Handle] = None

# Each replaced operator's kernel, by the name of the module global that implements it.
_KERNELS = dict(zip(OPERATORS, ("_sdpa_forward", "_sdpa_backward", "_flash_forward", "_flash_backward")))


def _activate(tau: float, dispatch_key: str = "CUDA") -> _Handle:
    """The registry's register_fn.  dispatch_key is for the CPU tests, which register the same kernels
    at "CPU" to run aten's autograd formulas and varlen_attn through them without a GPU."""
    global _ACTIVE
    lib = torch.library.Library("aten", "IMPL", dispatch_key)  # noqa: TOR901 (overriding aten kernels is the point)
    with warnings.catch_warnings():
        # torch warns that a kernel it ships is overridden: the user asked for exactly that.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for op, name in _KERNELS.items():
            # Looked up by name at each call (a module global), so a test can wrap one.
            lib.impl(op, lambda *a, _name=name, **kw: globals()[_name](tau, *a, **kw), dispatch_key)
    _ACTIVE = _Handle(lib, tau)
    return _ACTIVE


# ---- the kernels ------------------------------------------------------------------------------

def _unsupported(what, got, fix):
    return NotImplementedError(f"{what}: MALA (active as torch's flash-attention implementation) does not "
                               f"support it (got {got}); {fix}, or torch.nn.attention.restore_flash_attention_impl()")


def _check_forward(dropout_p, return_debug_mask=False, alibi_slopes=None, seqused_k=None):
    if dropout_p != 0.0:
        raise _unsupported("dropout_p", dropout_p, "set dropout to 0 (model.eval(), attention_dropout=0), keep the "
                           "call off the flash backend with torch.nn.attention.sdpa_kernel([SDPBackend."
                           "EFFICIENT_ATTENTION, SDPBackend.MATH])")
    if return_debug_mask:
        raise _unsupported("return_debug_mask", True, "MALA has no debug attention mask")
    if alibi_slopes is not None:
        raise _unsupported("alibi_slopes", "a tensor", "MALA has no attention bias")
    if seqused_k is not None:
        raise _unsupported("seqused_k", "a tensor", "pass cu_seq_k with the used lengths")


def _causal_from_window(is_causal, window_size_left, window_size_right):
    """varlen_attn spells causal as window (-1, 0): accept that and no window; refuse a real window."""
    left = -1 if window_size_left is None else window_size_left
    right = -1 if window_size_right is None else window_size_right
    if left == -1 and (right == -1 or (right == 0 and is_causal)):
        return is_causal
    raise _unsupported("window_size", (left, right), "MALA has no sliding window (only (-1, -1) and causal (-1, 0))")


def _meta_strides(like):
    return torch.empty_like(like, device="meta").stride()


def _like(t, like):
    """t with the strides torch's meta function gives this output (empty_like(like)), which compiled
    graphs assume: a copy only where MALA's layout differs (e.g. a [B, H, N, d]-contiguous query)."""
    if t.stride() == _meta_strides(like):
        return t
    return torch.empty_like(like).copy_(t)


def _no_rng(query):
    """The rng_state / philox_offset / debug-mask outputs of a flash forward without dropout (meta's
    shapes and dtypes)."""
    return (torch.zeros((2,), dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _forward(tau, q, k, v, causal, scale, varlen=None):
    """out, lse of mala.attention / attention_varlen ([B, N, H, d] / [total, H, d]).  Under no_grad:
    aten's autograd owns the graph, so mala's own must not record (nor the forward its tile mask)."""
    with torch.no_grad():
        if varlen is None:
            return api.attention(q, k, v, tau=tau, causal=causal, softmax_scale=scale, return_lse=True)
        cu_q, cu_k, max_q, max_k = varlen
        # Offsets unchecked, as torch's flash kernel leaves them: no host synchronization.
        return api.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau=tau, causal=causal, softmax_scale=scale,
                                    return_lse=True, check_inputs=False)


def _backward(tau, dout, q, k, v, out, lse, causal, scale, varlen=None):
    """dq, dk, dv from mala's backward without the forward's tile mask; head dims of no CUDA kernel run
    zero-padded, as the forward ran them."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else _scale_arg(scale, "scale")
    deterministic = torch.are_deterministic_algorithms_enabled()
    pad_to = _cuda_pad_target(q, k, v)
    if pad_to is not None:
        dout, q, k, v, out = (F.pad(t, (0, pad_to - d)) for t in (dout, q, k, v, out))
    if varlen is None:
        dq, dk, dv, _, _ = torch.ops.mala.bwd(dout, q, k, v, out, lse, tau, causal, scale, False, deterministic, None)
    else:
        cu_q, cu_k, max_q, max_k = varlen
        dq, dk, dv, _, _ = torch.ops.mala.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), tau,
                                                     causal, scale, False, deterministic, None)
    return (dq[..., :d], dk[..., :d], dv[..., :d]) if pad_to is not None else (dq, dk, dv)


def _check_sdpa_causal(is_causal, query, key):
    # torch's flash backend refuses this before dispatch; a direct call of the operator could still ask.
    if is_causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"is_causal: SDPA aligns the causal mask top-left when seqlen_q != seqlen_k "
                         f"({query.shape[2]} != {key.shape[2]}), MALA bottom-right; call mala.attention for that")


def _sdpa_forward(tau, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention: [B, H, N, d] in, torch's nine outputs out."""
    _check_forward(dropout_p, return_debug_mask)
    _check_sdpa_causal(is_causal, query, key)
    out, lse = _forward(tau, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), is_causal, scale)
    rng_state, philox_offset, debug_mask = _no_rng(query)
    return (_like(out.transpose(1, 2), query), lse.contiguous(), None, None, query.shape[2], key.shape[2], rng_state,
            philox_offset, debug_mask)


def _sdpa_backward(tau, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: dq, dk, dv in [B, H, N, d]."""
    _check_forward(dropout_p)
    _check_sdpa_causal(is_causal, query, key)
    grads = _backward(tau, *(t.transpose(1, 2) for t in (grad_out, query, key, value, out)), logsumexp, is_causal,
                      scale)
    return tuple(_like(g.transpose(1, 2), t) for g, t in zip(grads, (query, key, value)))


def _flash_forward(tau, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                   alibi_slopes=None):
    """aten::_flash_attention_forward (flash_attn's layout and bottom-right causal rule, as MALA's):
    dense [B, N, H, d], or packed [total, H, d] with cum_seq_q / cum_seq_k."""
    _check_forward(dropout_p, return_debug_mask, alibi_slopes, seqused_k)
    causal = _causal_from_window(is_causal, window_size_left, window_size_right)
    varlen = None if cum_seq_q is None else (cum_seq_q, cum_seq_k, max_q, max_k)
    result, lse = _forward(tau, query, key, value, causal, scale, varlen)
    return (_like(result, query), lse.contiguous()) + _no_rng(query)


def _flash_backward(tau, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """aten::_flash_attention_backward: dq, dk, dv in the forward's layout."""
    _check_forward(dropout_p)
    causal = _causal_from_window(is_causal, window_size_left, window_size_right)
    varlen = None if cum_seq_q is None else (cum_seq_q, cum_seq_k, max_q, max_k)
    grads = _backward(tau, grad_out, query, key, value, out, logsumexp, causal, scale, varlen)
    return tuple(_like(g, t) for g, t in zip(grads, (query, key, value)))

"""The user-facing functions (flash_attn conventions: [batch, seqlen, heads, head_dim], GQA by head
counts, bottom-right causal alignment when seqlen_q != seqlen_k).

Each is a thin wrapper over torch.ops.mala.*; autograd for attention/attention_varlen comes from
torch.library.register_autograd (mala/_ops.py), so both work under torch.compile(fullgraph=True).
return_stats=True runs the same operators through a small autograd.Function that also records the
backward's work; it is for eager mode only.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Optional, Union

import torch

from . import _C, paged
from .stats import AttentionStats, visible_keys_decode, visible_keys_dense, visible_keys_varlen


SPLIT_RULES = ("per_split", "seeded")  # attention_with_kvcache's split_rule (mala::SplitRule)
MAX_NUM_SPLITS = 128  # attention_with_kvcache's largest num_splits (mala::kMaxNumSplits, flash_attn's bound)
CUDA_HEAD_DIMS = (64, 128, 256)  # the CUDA kernels' head dims: src/validate.cpp rejects others on CUDA


def _pad_target(head_dim: int) -> Optional[int]:
    """The kernel head dim a CUDA call of attention / attention_varlen runs a head_dim of no kernel at:
    the next of CUDA_HEAD_DIMS (None: run as is; over 256, the library's error)."""
    if head_dim in CUDA_HEAD_DIMS or not 0 < head_dim <= CUDA_HEAD_DIMS[-1]:
        return None
    return next(x for x in CUDA_HEAD_DIMS if x >= head_dim)


def _cuda_pad_target(q, k, v) -> Optional[int]:
    """_pad_target for a CUDA call whose q, k and v agree on head_dim (else the library names the
    mismatch)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in (q, k, v)) or not q.is_cuda:
        return None
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        return None
    return _pad_target(d)


def _call_padded(fn, pad_to: int, q, k, v, softmax_scale, kwargs):
    """fn(q, k, v, ...) at head dim pad_to: zeros appended to q, k and v change no score and give output
    columns of zeros, which are dropped (the result is a view, as flash_attn's is).  The scale stays
    1/sqrt(head_dim) of the caller's head_dim unless given.  Gradients flow through the padding."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qp, kp, vp = (torch.nn.functional.pad(t, (0, pad_to - d)) for t in (q, k, v))
    res = fn(qp, kp, vp, softmax_scale=scale, **kwargs)
    if isinstance(res, tuple):
        return (res[0][..., :d],) + tuple(res[1:])
    return res[..., :d]


def _scale_arg(softmax_scale, name="softmax_scale"):
    """The scale as the operators take it (0.0: the library's 1/sqrt(head_dim)); `name` is the
    caller's name for the argument (torch's SDPA calls it `scale`)."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"{name}: must be finite and > 0, or None for 1/sqrt(head_dim) (got {softmax_scale})")
    return scale


def _tau_arg(tau, name="tau"):
    """tau as the operators take it; the one check of tau in the package (layer_tau and mala_hf.register
    use it too).  `name` is how the message names the value (tau[3] for a list's entry)."""
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: must be a number, finite and >= 0 (got {tau!r})") from None
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}: must be finite and >= 0 (got {tau})")
    return value


TauSpec = Union[float, Sequence[float], Mapping[Union[int, str], float], Callable[[int], float]]


def check_tau_spec(tau: TauSpec) -> TauSpec:
    """Validates a per-layer tau spec (see layer_tau) without a layer: a number, and every value of a
    list, tuple or dict, get mala.attention's check now; a callable is checked at each use.  Returns the
    spec with its values as floats (the list as a tuple, so that later edits to the caller's list do not
    change it)."""
    if callable(tau):
        return tau
    if isinstance(tau, (list, tuple)):
        if not tau:
            raise ValueError("tau: a per-layer list must have one entry per layer (got an empty one)")
        return tuple(_tau_arg(t, f"tau[{i}]") for i, t in enumerate(tau))
    if isinstance(tau, Mapping):
        checked = {}
        for key, t in tau.items():
            if key != "default" and (isinstance(key, bool) or not isinstance(key, int) or key < 0):
                raise ValueError(f"tau: a per-layer dict's keys must be layer indices >= 0 or 'default' (got {key!r})")
            checked[key] = _tau_arg(t, f"tau[{key!r}]")
        return checked
    return _tau_arg(tau)


def layer_tau(tau: TauSpec, layer_idx: Optional[int]) -> float:
    """The tau of layer `layer_idx` (0-based, as transformers' module.layer_idx) under a per-layer spec:

      a number                the same tau for every layer;
      a list or tuple         tau[layer_idx]; one entry per layer (a shorter one raises at its first
                              missing layer);
      a dict                  {layer_idx: tau, ..., "default": tau}; layers not named take "default"
                              (without one, a layer not named raises);
      a callable              tau(layer_idx) -> float, called at each use.

    Every value gets mala.attention's check (finite and >= 0), named by where it came from.  For
    mala.attention callers: mala.attention(q, k, v, tau=mala.layer_tau(spec, i)).
    """
    if not callable(tau) and not isinstance(tau, (list, tuple, Mapping)):
        return _tau_arg(tau)
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
        raise ValueError(f"tau: a per-layer tau needs a layer index >= 0 (got layer_idx={layer_idx!r}); "
                         f"pass a number to use one tau without layers")
    if callable(tau):
        return _tau_arg(tau(layer_idx), f"tau({layer_idx})")
    if isinstance(tau, (list, tuple)):
        if layer_idx >= len(tau):
            raise ValueError(f"tau: the per-layer list has {len(tau)} entries, so none for layer {layer_idx} "
                             f"(give one per layer, or a dict with a 'default')")
        return _tau_arg(tau[layer_idx], f"tau[{layer_idx}]")
    if layer_idx in tau:
        return _tau_arg(tau[layer_idx], f"tau[{layer_idx}]")
    if "default" in tau:
        return _tau_arg(tau["default"], "tau['default']")
    raise ValueError(f"tau: the per-layer dict has no entry for layer {layer_idx} and no 'default'")


def _eager_only(what):
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{what}: not supported under torch.compile; call mala eagerly to collect stats")


def _host_checks_allowed(t):
    """Value checks of index tensors copy them to the host: skipped while compiling or capturing."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _gather_paged(k, v, block_table, cu_seqlens_k, max_seqlen_k, check_inputs):
    """attention_varlen's packed k/v from paged ones, and whether cu_seqlens_k's values were checked.
    The values are read on the host where that is free (CPU) or asked for (check_inputs), which also
    gives the exact packed row count; otherwise the gather runs without a synchronization
    (mala/paged.py, gather_paged_kv)."""
    paged.check_paged_shapes(k, v, block_table, cu_seqlens_k)
    total_k = None
    if (check_inputs or not k.is_cuda) and _host_checks_allowed(k):
        total_k = paged.check_paged_values(k, block_table, cu_seqlens_k, max_seqlen_k)[-1]
    k, v = paged.gather_paged_kv(k, v, block_table, cu_seqlens_k, max_seqlen_k, total_k)
    return k, v, total_k is not None


def _check_cu_seqlens(cu, name, total, max_seqlen, max_name):
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name}: must be a 1-D int32 tensor of batch + 1 >= 2 offsets")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: must start at 0 (got {values[0]})")
    for b in range(len(values) - 1):
        n = values[b + 1] - values[b]
        if n < 0:
            raise ValueError(f"{name}: must be non-decreasing (entry {b + 1} = {values[b + 1]} < entry {b} = {values[b]})")
        if n > max_seqlen:
            raise ValueError(f"{name}: sequence {b} has length {n} > {max_name} = {max_seqlen}")
    if values[-1] != total:
        raise ValueError(f"{name}: last entry {values[-1]} must equal the number of rows {total}")


def _autocast_inputs(*tensors):
    """Under CUDA autocast, floating-point CUDA inputs in another precision are cast to autocast's
    dtype, as autocast does for torch's scaled_dot_product_attention (its float32 inputs would
    otherwise be refused: the kernels take float16 and bfloat16)."""
    if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors) or not torch.is_autocast_enabled("cuda"):
        return tensors
    dt = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point() and t.dtype != dt
                 else t for t in tensors)


def _needs_grad(*tensors):
    """Whether autograd will run the backward of a call on these inputs: then the forward records its
    tile mask where the backward reads it (the backward skips, without scoring them, the tiles the
    forward skipped)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _results(out, lse, stats, return_lse, return_stats):
    extra = ((lse,) if return_lse else ()) + ((stats,) if return_stats else ())
    return (out,) + extra if extra else out


class _AttentionWithStats(torch.autograd.Function):
    """The same operators as the registered autograd, also filling an AttentionStats (eager only)."""

    @staticmethod
    def forward(ctx, q, k, v, tau, causal, softmax_scale, stats, varlen, deterministic):
        if varlen is None:
            out, lse, slots, mask = torch.ops.mala.fwd(q, k, v, tau, causal, softmax_scale, True)
            ctx.save_for_backward(q, k, v, out, lse, mask)
        else:
            cu_q, cu_k, max_q, max_k = varlen
            out, lse, slots, mask = torch.ops.mala.fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, tau, causal,
                                                              softmax_scale, True)
            ctx.save_for_backward(q, k, v, out, lse, mask, cu_q, cu_k)
            ctx.max_seqlens = (max_q, max_k)
        stats.fwd_slots, stats.fwd_tile_mask = slots, mask
        ctx.rule = (tau, causal, softmax_scale, deterministic)
        ctx.stats = stats
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        tau, causal, softmax_scale, deterministic = ctx.rule
        # saved_tensors is read once: a second read fails under torch.utils.checkpoint (non-reentrant).
        saved = ctx.saved_tensors
        # The forward's tile mask goes to the backward as autograd's does (see mala/_ops.py).
        if len(saved) == 6:
            q, k, v, out, lse, fwd_mask = saved
            dq, dk, dv, slots, mask = torch.ops.mala.bwd(dout, q, k, v, out, lse, tau, causal, softmax_scale, True,
                                                         deterministic, fwd_mask)
            seqlen_q, seqlen_k, batch = q.shape[1], k.shape[1], q.shape[0]
        else:
            q, k, v, out, lse, fwd_mask, cu_q, cu_k = saved
            seqlen_q, seqlen_k = ctx.max_seqlens
            batch = cu_q.numel() - 1
            dq, dk, dv, slots, mask = torch.ops.mala.bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, seqlen_q,
                                                                seqlen_k, tau, causal, softmax_scale, True,
                                                                deterministic, fwd_mask)
        stats = ctx.stats
        stats.bwd_block_q, stats.bwd_block_k, _ = torch.ops.mala.tile_sizes(
            "backward", q.device, q.dtype, batch, seqlen_q, seqlen_k, q.shape[-2], k.shape[-2], q.shape[-1], causal, 0)
        stats.bwd_slots, stats.bwd_tile_mask = slots, mask
        return dq, dk, dv, None, None, None, None, None, None


def _new_stats(q, k, batch, seqlen_q, seqlen_k, causal, visible_keys):
    block_q, block_k, _ = torch.ops.mala.tile_sizes("forward", q.device, q.dtype, batch, seqlen_q, seqlen_k,
                                                    q.shape[-2], k.shape[-2], q.shape[-1], causal, 0)
    return AttentionStats(fwd_block_q=block_q, fwd_block_k=block_k, fwd_slots=torch.empty(0), visible_keys=visible_keys)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: float = 1.0, causal: bool = True,
              softmax_scale: Optional[float] = None, return_lse: bool = False, return_stats: bool = False,
              deterministic: bool = False):
    """MALA attention.  q [B, Nq, Hq, d], k/v [B, Nk, Hkv, d] (Hq % Hkv == 0) -> out [B, Nq, Hq, d].

    tau = 0 is exact dense attention; tau = 1 the paper's default tolerance.  causal aligns the
    diagonal bottom-right (row i sees keys <= i + Nk - Nq).  CUDA: float16/bfloat16, head_dim up to
    256 (the kernels' are 64, 128 and 256; another head_dim runs at the next of those, its inputs
    zero-padded and out a view of the first head_dim columns); CPU tensors run the exact CPU
    implementation (float32 too).  Differentiable in q, k, v.
    deterministic: the backward's gradients are bit-identical from run to run (CUDA: sm_90; the CPU
    always is).  Returns out, then lse [B, Hq, Nq] float32 if return_lse, then an
    AttentionStats if return_stats.
    """
    tau = _tau_arg(tau)
    scale = _scale_arg(softmax_scale)
    q, k, v = _autocast_inputs(q, k, v)
    pad_to = _cuda_pad_target(q, k, v)
    if pad_to is not None:
        return _call_padded(attention, pad_to, q, k, v, softmax_scale,
                            dict(tau=tau, causal=causal, return_lse=return_lse, return_stats=return_stats,
                                 deterministic=deterministic))
    if not return_stats:
        out, lse, _, _ = torch.ops.mala.fwd(q, k, v, tau, causal, scale, False, bool(deterministic),
                                            _needs_grad(q, k, v))
        return _results(out, lse, None, return_lse, False)
    _eager_only("return_stats")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError("q: must have 4 dimensions [batch, seqlen, heads, head_dim]")
    stats = _new_stats(q, k, q.shape[0], q.shape[1], k.shape[1], causal,
                       visible_keys_dense(q.shape[1], k.shape[1], causal, q.device))
    out, lse = _AttentionWithStats.apply(q, k, v, tau, causal, scale, stats, None, bool(deterministic))
    return _results(out, lse, stats, return_lse, True)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 *, tau: float = 1.0):
    """torch.nn.functional.scaled_dot_product_attention's signature and [B, H, N, d] layout over
    attention (plus the keyword-only tau; tau = 0 is exact dense attention).  query [B, Hq, Nq, d],
    key/value [B, Hkv, Nk, d] -> [B, Hq, Nq, d] (a transposed view, as the inputs are passed).

    What MALA does not do raises, naming the argument: an attn_mask (no masks but the causal one),
    dropout_p > 0, is_causal with Nq != Nk (torch aligns that mask top-left, MALA bottom-right as
    flash_attn does: call attention), Hq != Hkv without enable_gqa=True (as torch does).
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: MALA takes no attention mask (is_causal=True for the causal one)")
    if float(dropout_p) != 0.0:
        raise NotImplementedError(f"dropout_p: MALA has no attention dropout (got {dropout_p}; only 0.0)")
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: must be a 4-D tensor [batch, heads, seqlen, head_dim]")
    if is_causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"is_causal: torch aligns the causal mask top-left when seqlen_q != seqlen_k "
                         f"({query.shape[2]} != {key.shape[2]}), MALA bottom-right (flash_attn's convention); "
                         f"call mala.attention for that")
    _scale_arg(scale, "scale")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"enable_gqa: query has {query.shape[1]} heads and key {key.shape[1]}; pass enable_gqa=True "
                         f"(as for torch's scaled_dot_product_attention)")
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), tau=tau, causal=is_causal,
                    softmax_scale=scale)
    return out.transpose(1, 2)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, tau: float = 1.0,
                     causal: bool = True, softmax_scale: Optional[float] = None, return_lse: bool = False,
                     return_stats: bool = False, check_inputs: bool = True, deterministic: bool = False,
                     block_table: Optional[torch.Tensor] = None):
    """MALA attention over packed sequences.  q [total_q, Hq, d], k/v [total_k, Hkv, d]; sequence b is
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (and likewise for k).  cu_seqlens_* are int32
    [batch + 1] on the device of q.  lse is [Hq, total_q].  check_inputs validates the offsets on the
    host (one synchronization; skipped under torch.compile and CUDA-graph capture).  deterministic and
    head dims as for attention.

    block_table: paged keys (flash_attn_varlen_func's): k/v [num_blocks, page_size, Hkv, d] and
    block_table int32 [batch, max_blocks], sequence b's key j at k[block_table[b, j // page_size],
    j % page_size]; cu_seqlens_k then gives the key counts.  The pages are gathered into packed k/v
    (one copy of the used keys, mala/paged.py) for the contiguous call, whose decisions and results
    this gives.  Differentiable: dK/dV come back in the paged shape.  check_inputs (always on the
    CPU) also checks the used block_table entries and that each sequence fits its pages.
    """
    tau = _tau_arg(tau)
    scale = _scale_arg(softmax_scale)
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    k_checked = False  # cu_seqlens_k's values already checked on the host (by the paged gather)
    if block_table is not None:
        # Gathered before autocast and head-dim padding, so that those touch the used keys only.
        k, v, k_checked = _gather_paged(k, v, block_table, cu_seqlens_k, max_seqlen_k, check_inputs)
    q, k, v = _autocast_inputs(q, k, v)
    pad_to = _cuda_pad_target(q, k, v)
    if pad_to is not None:
        return _call_padded(lambda qp, kp, vp, **kw: attention_varlen(qp, kp, vp, cu_seqlens_q, cu_seqlens_k,
                                                                      max_seqlen_q, max_seqlen_k, **kw),
                            pad_to, q, k, v, softmax_scale,
                            dict(tau=tau, causal=causal, return_lse=return_lse, return_stats=return_stats,
                                 check_inputs=check_inputs, deterministic=deterministic))
    if check_inputs and _host_checks_allowed(q):
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_seqlen_q, "max_seqlen_q")
        if not k_checked:  # one host copy of cu_seqlens_k per call
            _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], max_seqlen_k, "max_seqlen_k")
        if cu_seqlens_k.numel() != cu_seqlens_q.numel():
            raise ValueError(f"cu_seqlens_k: must have {cu_seqlens_q.numel()} entries like cu_seqlens_q "
                             f"(got {cu_seqlens_k.numel()})")
    if not return_stats:
        out, lse, _, _ = torch.ops.mala.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   tau, causal, scale, False, bool(deterministic),
                                                   _needs_grad(q, k, v))
        return _results(out, lse, None, return_lse, False)
    _eager_only("return_stats")
    stats = _new_stats(q, k, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, causal,
                       visible_keys_varlen(cu_seqlens_q, cu_seqlens_k, causal))
    out, lse = _AttentionWithStats.apply(q, k, v, tau, causal, scale, stats,
                                         (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                                         bool(deterministic))
    return _results(out, lse, stats, return_lse, True)


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: Union[torch.Tensor, int], k: Optional[torch.Tensor] = None,
                           v: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                           tau: float = 1.0, causal: bool = True, softmax_scale: Optional[float] = None,
                           num_splits: int = 0, return_lse: bool = False, return_stats: bool = False,
                           check_inputs: bool = False, split_rule: str = "seeded"):
    """Decode / chunked prefill against a KV cache (flash_attn_with_kvcache semantics, no autograd).

    q [B, Nq, Hq, d]; k_cache/v_cache [B, capacity, Hkv, d], or paged [num_blocks, page_size, Hkv, d]
    with block_table int32 [B, max_pages]; cache_seqlens int32 [B] (or an int): keys already cached.
    k/v [B, Nnew, Hkv, d], if given, are written into the cache in place at cache_seqlens[b] before
    attending; attention then sees cache_seqlens[b] + Nnew keys, bottom-right causal.  cache_seqlens
    itself is not advanced.  num_splits 0 = automatic split-KV.  Capturable in a CUDA graph.

    split_rule: how each split of split-KV tests its tiles (docs/spec.md, "Split rules"): "seeded"
    (the default: every split also counts the exact mass of the anchor tiles, key tile 0 and the
    newest tile, so far splits skip about what one split would; same bound) or "per_split" (the
    paper's rule: far splits keep nearly every tile).  With one split both are the forward rule.
    CPU and CUDA tensors implement both.

    check_inputs: off by default, as in flash_attn, so that the call never synchronizes with the host.
    The values of cache_seqlens and block_table are then not checked: out-of-range lengths
    (cache_seqlens[b] < 0 or cache_seqlens[b] + Nnew > capacity) or page indices outside
    [0, num_blocks) are undefined behaviour (the kernels may read, and append, out of bounds).  True
    validates them at the cost of one host synchronization (skipped under torch.compile and CUDA-graph
    capture).  Shapes, dtypes and devices are always checked.  (CPU tensors are also checked by the
    CPU implementation, which reads them on the host anyway.)
    """
    # A decode step's host time adds to its latency: the common call (no lse, no stats, no host
    # check) goes from these checks straight to the operator and returns its output.
    tau = _tau_arg(tau)
    scale = _scale_arg(softmax_scale)
    splits = int(num_splits)
    if not 0 <= splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits: must be in [0, {MAX_NUM_SPLITS}], 0 meaning automatic (got {num_splits})")
    if split_rule not in SPLIT_RULES:
        raise ValueError(f"split_rule: must be one of {', '.join(repr(r) for r in SPLIT_RULES)} (got {split_rule!r})")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if check_inputs and _host_checks_allowed(q) and isinstance(cache_seqlens, torch.Tensor) \
            and cache_seqlens.dtype == torch.int32 and k_cache.dim() == 4:
        seqlen_new = 0 if k is None else k.shape[1]
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None and block_table.dim() == 2
                                       else 1)
        lengths = cache_seqlens.tolist()
        for b, n in enumerate(lengths):
            if n < 0 or n + seqlen_new > capacity:
                raise ValueError(f"cache_seqlens: entry {b} = {n} plus {seqlen_new} new keys is outside the cache "
                                 f"capacity {capacity}")
        if block_table is not None and block_table.dtype == torch.int32 and block_table.numel():
            lo, hi = int(block_table.min()), int(block_table.max())
            if lo < 0 or hi >= k_cache.shape[0]:
                raise ValueError(f"block_table: entries must lie in [0, {k_cache.shape[0]}) (got {lo}..{hi})")
    if not (return_stats or torch.compiler.is_compiling()):
        # The eager call skips the dispatcher (host time, which a decode step waits
        # for); the extension hands back NotImplemented where the dispatcher would do something
        # else (tensor subclasses, dispatch or torch-function modes), and the operator runs then.
        r = _C.kvcache_direct(q, k_cache, v_cache, cache_seqlens, k, v, block_table, tau, bool(causal), scale, splits,
                              split_rule, bool(return_lse))
        if r is not NotImplemented:
            return r
    out, lse, slots = torch.ops.mala.kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, tau, causal,
                                             scale, splits, bool(return_stats), split_rule)
    if not (return_lse or return_stats):
        return out
    stats = None
    if return_stats:
        _eager_only("return_stats")
        seqlen_new = 0 if k is None else k.shape[1]
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        block_q, block_k, splits = torch.ops.mala.tile_sizes("decode", q.device, q.dtype, q.shape[0], q.shape[1],
                                                             capacity, q.shape[2], k_cache.shape[2], q.shape[3],
                                                             causal, splits)
        stats = AttentionStats(fwd_block_q=block_q, fwd_block_k=block_k, fwd_slots=slots, num_splits=splits,
                               visible_keys=visible_keys_decode(cache_seqlens, seqlen_new, q.shape[1], causal))
    return _results(out, lse, stats, return_lse, return_stats)


def tile_sizes(kernel: str, q: torch.Tensor, k: torch.Tensor, causal: bool = True, num_splits: int = 0):
    """(block_q, block_k) the named kernel ('forward', 'backward', 'decode') uses for these inputs.  On
    CUDA a head_dim of no kernel gives the tiles of the head dim attention pads it to (decode: the
    library's error, as decode does not pad)."""
    batch, seqlen_q = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    seqlen_k = k.shape[1] if k.dim() == 4 else k.shape[0]
    head_dim = q.shape[-1]
    if q.is_cuda and kernel != "decode":
        head_dim = _pad_target(head_dim) or head_dim
    block_q, block_k, _ = torch.ops.mala.tile_sizes(kernel, q.device, q.dtype, batch, seqlen_q, seqlen_k,
                                                    q.shape[-2], k.shape[-2], head_dim, causal, int(num_splits))
    return block_q, block_k

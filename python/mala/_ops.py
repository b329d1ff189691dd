"""Fake (meta) implementations and autograd for the C++ operators torch.ops.mala.*.

The fake implementations give torch.compile and FakeTensor the output shapes without running
anything; autograd pairs mala::fwd with mala::bwd (and the varlen pair).  The gradient does not
flow through the returned lse (as flash_attn): lse is marked non-differentiable.
"""

import torch

_EMPTY = (0,)


def _same_device(q, **tensors):
    """The device check of the C++ operators (python/csrc/ops.cpp, check_like), for the fake
    implementations: without it a meta tensor among CPU ones reached the Meta kernel, which returned a
    CPU tensor of uninitialised memory."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: must be on the same device as q ({q.device}), got {t.device}")


def _stats_outputs(kernel, q, rows_shape, batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, wanted,
                   block_q=0, block_k=0, mask_for_backward=None):
    """Fake slots and tile-mask tensors (empty unless return_stats); block_q/block_k 0 = the
    implementation's tiles.  mask_for_backward (tau, deterministic): a forward with record_for_backward,
    whose tile mask exists where the backward reads it (torch.ops.mala.forward_mask_tiles)."""
    if not wanted:
        empty_slots = q.new_empty(_EMPTY, dtype=torch.int32)
        tiles = [] if mask_for_backward is None else torch.ops.mala.forward_mask_tiles(
            q.device, q.dtype, int(batch), int(seqlen_q), int(seqlen_k), int(heads_q), int(heads_kv),
            int(q.shape[-1]), causal, float(mask_for_backward[0]), bool(mask_for_backward[1]))
        if not tiles:
            return empty_slots, q.new_empty(_EMPTY, dtype=torch.uint8)
        mask_shape = (batch, heads_q, -(-seqlen_q // tiles[0]), -(-seqlen_k // tiles[1]))
        return empty_slots, q.new_empty(mask_shape, dtype=torch.uint8)
    if block_q == 0 or block_k == 0:
        block_q, block_k, _ = torch.ops.mala.tile_sizes(
            kernel, q.device, q.dtype, int(batch), int(seqlen_q), int(seqlen_k), int(heads_q), int(heads_kv),
            int(q.shape[-1]), causal, 0)
    mask_shape = (batch, heads_q, -(-seqlen_q // block_q), -(-seqlen_k // block_k))
    return q.new_empty(rows_shape, dtype=torch.int32), q.new_empty(mask_shape, dtype=torch.uint8)


@torch.library.register_fake("mala::fwd")
def _fwd_fake(q, k, v, tau, causal, softmax_scale, return_stats, deterministic=False, record_for_backward=False):
    _same_device(q, k=k, v=v)
    batch, seqlen_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    slots, tile_mask = _stats_outputs("forward", q, lse.shape, batch, seqlen_q, k.shape[1], heads_q, k.shape[2],
                                      causal, return_stats,
                                      mask_for_backward=(tau, deterministic) if record_for_backward else None)
    return q.new_empty(q.shape), lse, slots, tile_mask


@torch.library.register_fake("mala::fwd_varlen")
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tau, causal, softmax_scale,
                     return_stats, deterministic=False, record_for_backward=False):
    _same_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    total_q, heads_q, _ = q.shape
    lse = q.new_empty((heads_q, total_q), dtype=torch.float32)
    slots, tile_mask = _stats_outputs("forward", q, lse.shape, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k,
                                      heads_q, k.shape[1], causal, return_stats,
                                      mask_for_backward=(tau, deterministic) if record_for_backward else None)
    return q.new_empty(q.shape), lse, slots, tile_mask


@torch.library.register_fake("mala::bwd")
def _bwd_fake(dout, q, k, v, out, lse, tau, causal, softmax_scale, return_stats, deterministic=False,
              fwd_tile_mask=None):
    _same_device(q, dout=dout, k=k, v=v, out=out, lse=lse)
    batch, seqlen_q, heads_q, _ = q.shape
    slots, tile_mask = _stats_outputs("backward", q, lse.shape, batch, seqlen_q, k.shape[1], heads_q, k.shape[2],
                                      causal, return_stats)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), slots, tile_mask


@torch.library.register_fake("mala::bwd_varlen")
def _bwd_varlen_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tau, causal,
                     softmax_scale, return_stats, deterministic=False, fwd_tile_mask=None):
    _same_device(q, dout=dout, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    slots, tile_mask = _stats_outputs("backward", q, lse.shape, cu_seqlens_q.shape[0] - 1, max_seqlen_q,
                                      max_seqlen_k, q.shape[1], k.shape[1], causal, return_stats)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), slots, tile_mask


@torch.library.register_fake("mala::fwd_split")
def _fwd_split_fake(q, k, v, seed_lse, rows_before, owns_tile0, owns_newest, tau, causal, softmax_scale, block_q,
                    block_k, return_stats):
    _same_device(q, k=k, v=v, seed_lse=seed_lse)
    batch, seqlen_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    slots, tile_mask = _stats_outputs("forward", q, lse.shape, batch, seqlen_q, k.shape[1], heads_q, k.shape[2],
                                      causal, return_stats, block_q, block_k)
    return q.new_empty(q.shape), lse, slots, tile_mask


@torch.library.register_fake("mala::bwd_split")
def _bwd_split_fake(dout, q, k, v, out, lse, rows_before, tau, causal, softmax_scale, block_q, block_k,
                    return_stats, deterministic):
    _same_device(q, dout=dout, k=k, v=v, out=out, lse=lse)
    batch, seqlen_q, heads_q, _ = q.shape
    slots, tile_mask = _stats_outputs("backward", q, lse.shape, batch, seqlen_q, k.shape[1], heads_q, k.shape[2],
                                      causal, return_stats, block_q, block_k)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), slots, tile_mask


@torch.library.register_fake("mala::kvcache")
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, tau, causal, softmax_scale, num_splits,
                  return_stats, split_rule="seeded"):
    _same_device(q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k=k, v=v, block_table=block_table)
    batch, seqlen_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    slots = q.new_empty(lse.shape if return_stats else _EMPTY, dtype=torch.int32)
    return q.new_empty(q.shape), lse, slots


# ---- autograd -------------------------------------------------------------------------------

# The forward's tile mask (empty unless it was recorded: return_stats, or record_for_backward where the
# backward reads one) goes to the backward, which then skips the tiles the forward skipped without
# scoring them.

def _fwd_setup_context(ctx, inputs, output):
    q, k, v, tau, causal, softmax_scale, _, *rest = inputs
    out, lse, _, tile_mask = output
    ctx.save_for_backward(q, k, v, out, lse, tile_mask)
    ctx.rule = (tau, causal, softmax_scale, bool(rest[0]) if rest else False)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse, _dslots, _dmask):
    q, k, v, out, lse, tile_mask = ctx.saved_tensors
    tau, causal, softmax_scale, deterministic = ctx.rule
    dq, dk, dv, _, _ = torch.ops.mala.bwd(dout, q, k, v, out, lse, tau, causal, softmax_scale, False, deterministic,
                                          tile_mask)
    return dq, dk, dv, None, None, None, None, None, None


def _fwd_varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tau, causal, softmax_scale, _, *rest = inputs
    out, lse, _, tile_mask = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, tile_mask)
    ctx.rule = (max_seqlen_q, max_seqlen_k, tau, causal, softmax_scale, bool(rest[0]) if rest else False)
    ctx.mark_non_differentiable(lse)


def _fwd_varlen_backward(ctx, dout, _dlse, _dslots, _dmask):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, tile_mask = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, tau, causal, softmax_scale, deterministic = ctx.rule
    dq, dk, dv, _, _ = torch.ops.mala.bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                 max_seqlen_k, tau, causal, softmax_scale, False, deterministic,
                                                 tile_mask)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("mala::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("mala::fwd_varlen", _fwd_varlen_backward, setup_context=_fwd_varlen_setup_context)

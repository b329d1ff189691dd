"""Realized work of one MALA call (return_stats=True): slots per query row, tile decisions, tiles."""

from dataclasses import dataclass
from typing import Optional

import torch

# TileState values written into the tile masks (include/mala/tile_state.h).
TILE_ILLEGAL = 0  # no row of the query tile sees any key of the key tile
TILE_SKIPPED = 1  # scores computed, post-score work skipped
TILE_RETAINED = 2  # post-score work executed


@dataclass
class AttentionStats:
    """Work realized by one mala call.

    Per query row (shape [batch, heads_q, seqlen_q], varlen [heads_q, total_q], int32):
      fwd_slots: post-score key slots of the forward (block_k for every retained tile of the row)
      bwd_slots: the same for the backward; None until backward has run
    Tile decisions ([batch, heads_q, n_q_tiles, n_k_tiles], uint8 TILE_* values; decode: None):
      fwd_tile_mask, bwd_tile_mask
    visible_keys: keys each row may see (L_q), broadcastable to the slots; rows with 0 are not counted.
    """

    fwd_block_q: int
    fwd_block_k: int
    fwd_slots: torch.Tensor
    visible_keys: torch.Tensor
    fwd_tile_mask: Optional[torch.Tensor] = None
    bwd_block_q: Optional[int] = None
    bwd_block_k: Optional[int] = None
    bwd_slots: Optional[torch.Tensor] = None
    bwd_tile_mask: Optional[torch.Tensor] = None
    num_splits: Optional[int] = None  # decode only: the split-KV count used

    # ---- summaries --------------------------------------------------------------------------
    def _valid(self, slots):
        return torch.broadcast_to(self.visible_keys, slots.shape) > 0

    def _mean(self, slots):
        valid = self._valid(slots)
        return float(slots[valid].double().mean()) if bool(valid.any()) else 0.0

    @staticmethod
    def _tile_fraction(mask):
        retained = int((mask == TILE_RETAINED).sum())
        legal = retained + int((mask == TILE_SKIPPED).sum())
        return retained / legal if legal else 1.0

    def _slot_fraction(self, slots, block_k):
        # Fraction of each row's legal key-tile slots that were retained, pooled over valid rows.
        visible = torch.broadcast_to(self.visible_keys, slots.shape).long()
        legal = (visible + block_k - 1) // block_k * block_k
        valid = visible > 0
        total = int(legal[valid].sum())
        return int(slots.long()[valid].sum()) / total if total else 1.0

    @property
    def mean_fwd_slots(self) -> float:
        """Mean forward post-score key slots per query (rows that see at least one key)."""
        return self._mean(self.fwd_slots)

    @property
    def mean_bwd_slots(self) -> Optional[float]:
        return None if self.bwd_slots is None else self._mean(self.bwd_slots)

    @property
    def fwd_retained_fraction(self) -> float:
        """Retained / legal forward tiles (from the tile mask; decode: from the slots)."""
        if self.fwd_tile_mask is not None:
            return self._tile_fraction(self.fwd_tile_mask)
        return self._slot_fraction(self.fwd_slots, self.fwd_block_k)

    @property
    def bwd_retained_fraction(self) -> Optional[float]:
        return None if self.bwd_tile_mask is None else self._tile_fraction(self.bwd_tile_mask)

    def __repr__(self):
        parts = [f"fwd tiles {self.fwd_block_q}x{self.fwd_block_k}",
                 f"mean fwd slots {self.mean_fwd_slots:.1f}",
                 f"fwd retained {self.fwd_retained_fraction:.3f}"]
        if self.bwd_slots is not None:
            parts += [f"bwd tiles {self.bwd_block_q}x{self.bwd_block_k}",
                      f"mean bwd slots {self.mean_bwd_slots:.1f}",
                      f"bwd retained {self.bwd_retained_fraction:.3f}"]
        if self.num_splits is not None:
            parts.append(f"splits {self.num_splits}")
        return "AttentionStats(" + ", ".join(parts) + ")"


# ---- visible keys per row (L_q, bottom-right causal) --------------------------------------------

def visible_keys_dense(seqlen_q, seqlen_k, causal, device):
    """[1, 1, seqlen_q] int64."""
    if not causal:
        return torch.full((1, 1, seqlen_q), seqlen_k, dtype=torch.int64, device=device)
    rows = torch.arange(seqlen_q, device=device)
    return (rows + seqlen_k - seqlen_q + 1).clamp(0, seqlen_k).view(1, 1, seqlen_q)


def visible_keys_varlen(cu_seqlens_q, cu_seqlens_k, causal):
    """[1, total_q] int64 from the offsets."""
    cu_q = cu_seqlens_q.long()
    len_q = cu_q[1:] - cu_q[:-1]
    len_k = (cu_seqlens_k.long()[1:] - cu_seqlens_k.long()[:-1])
    seq = torch.repeat_interleave(torch.arange(len_q.numel(), device=cu_q.device), len_q)
    lk = len_k[seq]
    if not causal:
        return lk.view(1, -1)
    row = torch.arange(seq.numel(), device=cu_q.device) - cu_q[seq]
    return (row + lk - len_q[seq] + 1).clamp(min=0).minimum(lk).view(1, -1)


def visible_keys_decode(cache_seqlens, seqlen_new, seqlen_q, causal):
    """[batch, 1, seqlen_q] int64: the cache holds cache_seqlens + seqlen_new keys."""
    lk = (cache_seqlens.long() + seqlen_new).view(-1, 1, 1)
    if not causal:
        return lk.expand(-1, 1, seqlen_q)
    rows = torch.arange(seqlen_q, device=cache_seqlens.device).view(1, 1, -1)
    return (rows + lk - seqlen_q + 1).clamp(min=0).minimum(lk)

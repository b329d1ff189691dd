"""Paged K/V for mala.attention_varlen (flash_attn_varlen_func's block_table): chunked prefill over a
paged cache.

k/v are [num_blocks, page_size, Hkv, d]; block_table int32 [batch, max_blocks] lists sequence b's
pages in order, so its key j lies at k[block_table[b, j // page_size], j % page_size]; cu_seqlens_k
gives each sequence's key count (its differences), not rows of k.

The first design: gather each sequence's pages into contiguous packed K/V with torch index ops on
the tensors' device, then run the contiguous varlen path.  The gathered tensors hold exactly the
keys the contiguous call would get, so the tile decisions are the same by construction (the layout
changes addressing, not the rule).  The cost is one copy of the used K/V; a kernel that reads the
pages directly is the later optimisation.  Autograd runs through the gather: dK/dV arrive in the
paged shape, zero on pages no sequence uses, summed where sequences share a page.
"""

from typing import List, Optional, Tuple

import torch


def check_paged_shapes(k, v, block_table, cu_seqlens_k) -> None:
    """The checks that need no host synchronization (always run): types, ranks, dtypes, devices and
    the agreement of k, v, block_table and cu_seqlens_k on num_blocks, page_size, heads and batch."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table: must be a torch.Tensor or None (got {type(block_table).__name__})")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table: must be a 2-D int32 tensor [batch, max_blocks] (got "
                         f"{block_table.dtype}, shape {tuple(block_table.shape)})")
    for t, name in ((k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: with block_table must be paged [num_blocks, page_size, heads_kv, head_dim] "
                             f"(got {got})")
    if k.shape[1] < 1:
        raise ValueError(f"k: page_size (dim 1) must be >= 1 (got shape {tuple(k.shape)})")
    for i, what in ((0, "num_blocks"), (1, "page_size"), (2, "heads_kv")):
        if v.shape[i] != k.shape[i]:
            raise ValueError(f"v: {what} (dim {i}) is {v.shape[i]}, k's is {k.shape[i]}: k and v share one "
                             f"page layout")
    if block_table.device != k.device or v.device != k.device:
        bad, dev = ("block_table", block_table.device) if block_table.device != k.device else ("v", v.device)
        raise ValueError(f"{bad}: must be on the device of k ({k.device}), got {dev}")
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dtype != torch.int32 \
            or cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() < 2:
        raise ValueError("cu_seqlens_k: must be a 1-D int32 tensor of batch + 1 >= 2 offsets")
    if cu_seqlens_k.device != k.device:
        raise ValueError(f"cu_seqlens_k: must be on the device of k ({k.device}), got {cu_seqlens_k.device}")
    batch = cu_seqlens_k.numel() - 1
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: has {block_table.shape[0]} rows, one per sequence is {batch} "
                         f"(cu_seqlens_k has {batch + 1} entries)")


def check_paged_values(k, block_table, cu_seqlens_k, max_seqlen_k) -> List[int]:
    """The host checks (one copy of each index tensor to the host); returns cu_seqlens_k's values.
    Only the pages a sequence uses are checked, as only they are read: the entries past them (a
    serving engine's padding, often -1 or 0) are not."""
    values = cu_seqlens_k.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens_k: must start at 0 (got {values[0]})")
    page_size, num_blocks, max_blocks = k.shape[1], k.shape[0], block_table.shape[1]
    table = block_table.tolist()
    for b in range(len(values) - 1):
        n = values[b + 1] - values[b]
        if n < 0:
            raise ValueError(f"cu_seqlens_k: must be non-decreasing (entry {b + 1} = {values[b + 1]} < entry {b} "
                             f"= {values[b]})")
        if n > max_seqlen_k:
            raise ValueError(f"cu_seqlens_k: sequence {b} has length {n} > max_seqlen_k = {max_seqlen_k}")
        pages = -(-n // page_size)
        if pages > max_blocks:
            raise ValueError(f"cu_seqlens_k: sequence {b} has {n} keys, more than block_table's {max_blocks} pages "
                             f"of page_size {page_size} hold ({max_blocks * page_size})")
        for j, page in enumerate(table[b][:pages]):
            if not 0 <= page < num_blocks:
                raise ValueError(f"block_table: entry [{b}, {j}] = {page} is outside [0, {num_blocks}) "
                                 f"(k has {num_blocks} pages)")
    return values


def _page_rows(block_table, cu_seqlens_k, page_size, num_blocks, rows):
    """(page, slot) per packed row, and whether the row is a key of some sequence.  Device ops only.
    Clamping keeps every index in bounds whatever the unchecked values are (a row past the last
    sequence, a -1 of a table's padding): the rows it affects are either invalid (zeroed) or, with
    check_inputs=False, the caller's undefined behaviour; it never reads outside k."""
    device = block_table.device
    r = torch.arange(rows, device=device, dtype=torch.int64)
    cu = cu_seqlens_k.to(torch.int64)
    batch = block_table.shape[0]
    # Sequence of row r: the number of sequence ends <= r (ends are cu[1:], non-decreasing).
    seq = torch.searchsorted(cu[1:], r, right=True).clamp_(max=batch - 1)
    j = r - cu[seq]
    valid = r < cu[-1]
    logical = (j // page_size).clamp_(0, max(block_table.shape[1] - 1, 0))
    page = block_table.to(torch.int64)[seq, logical].clamp_(0, num_blocks - 1)
    return page, j % page_size, valid


def gather_paged_kv(k, v, block_table, cu_seqlens_k, max_seqlen_k, total_k: Optional[int] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed k/v [rows, Hkv, d] holding sequence b's keys at rows cu_seqlens_k[b]:cu_seqlens_k[b+1].

    total_k (cu_seqlens_k[-1], when the caller has it on the host) gives exactly the packed tensor of
    the contiguous call.  Without it (CUDA without check_inputs, torch.compile, graph capture) the
    row count is a bound known without a synchronization, batch * min(max_seqlen_k, pages held), and
    the rows past cu_seqlens_k[-1] are zeros: the kernels read them only with zero weight (a packed
    tensor's rows after its last sequence), and torch.where also drops the uninitialised gradient
    the backward leaves in them, so nothing reaches the paged tensors from there."""
    batch, max_blocks = block_table.shape
    page_size, num_blocks = k.shape[1], k.shape[0]
    exact = total_k is not None
    rows = total_k if exact else batch * min(int(max_seqlen_k), max_blocks * page_size)
    if num_blocks == 0 or rows == 0:
        # No page to read: `rows` zero rows (unchecked values may still claim keys; a checked call has
        # rows == 0 here), padded from an empty slice so that autograd keeps its link to k and v.
        return tuple(torch.nn.functional.pad(t.flatten(0, 1)[:0], (0, 0, 0, 0, 0, rows)) for t in (k, v))
    page, slot, valid = _page_rows(block_table, cu_seqlens_k, page_size, num_blocks, rows)
    # Advanced indexing on (page, slot) reads only the used rows, also from a k/v whose page dims
    # cannot be flattened without a copy (a view of a [num_blocks, 2, page_size, ...] cache).
    k_packed, v_packed = k[page, slot], v[page, slot]
    if not exact:
        keep = valid.view(-1, 1, 1)
        k_packed = torch.where(keep, k_packed, k_packed.new_zeros(()))
        v_packed = torch.where(keep, v_packed, v_packed.new_zeros(()))
    return k_packed, v_packed

"""Context parallelism: MALA over a causal sequence sharded across the ranks of a process group.

    import mala.distributed as mcp
    q_local = mcp.zigzag_shard(q, rank, world_size)          # [B, 2C, Hq, d], likewise k, v
    out_local = mcp.attention(q_local, k_local, v_local, tau=1.0)   # differentiable

The sequence of N = 2 W C tokens is cut into 2W chunks of C tokens; rank r holds chunks r and
2W-1-r (zig-zag), so every rank does the same causal work.  Each pair (query chunk a, key chunk b),
b <= a, is one split of docs/spec.md's seeded split-KV rule (docs/distributed.md):

- Forward: the KV shards travel around the ring (the next shard is in flight while the current one
  is computed).  A pair calls torch.ops.mala.fwd_split with the row offset a * C, so the threshold
  uses each row's full causal length L_q, and with the seed: the exact mass of the anchor tiles (key
  tile 0 and the newest tiles of the row's query tile) that the pair does not own.  Key tile 0's K is
  broadcast once from rank 0; the newest tiles are in the diagonal chunk, which is local.  The partial
  results merge by their lse.  The bound eps_q <= tau / (1 + tau) holds as for one GPU.
- Backward: the offline rule against the final lse (no decision needs communication).  dq accumulates
  locally; K, V travel around the ring again with the running dk, dv, which come home after W steps.

Causal only.  Every rank must call with equal shapes and arguments (a mismatch between ranks is not
detected and may hang).  return_stats adds collectives (all_reduce), so all ranks must pass it alike.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .api import _scale_arg, _tau_arg
from .stats import TILE_RETAINED, TILE_SKIPPED

__all__ = ["attention", "zigzag_shard", "zigzag_unshard", "RingAttentionStats"]


# ---- zig-zag layout -----------------------------------------------------------------------------

def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of a full-sequence tensor: chunks rank and 2W-1-rank of 2W, concatenated.

    Pairing an early chunk with a late one gives every rank the same number of causal (query, key)
    chunk pairs, so no rank waits for another.
    """
    world_size, rank = int(world_size), int(rank)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank: must lie in [0, world_size = {world_size}) (got {rank})")
    n = x.shape[dim]
    if n % (2 * world_size):
        raise ValueError(f"x: length {n} along dim {dim} must be a multiple of 2 * world_size = {2 * world_size}")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor from the shards of ranks 0..W-1 (the inverse of zigzag_shard)."""
    world_size = len(shards)
    halves = [s.chunk(2, dim) for s in shards]
    order = [halves[c][0] if c < world_size else halves[2 * world_size - 1 - c][1] for c in range(2 * world_size)]
    return torch.cat(order, dim=dim)


def _chunk_ids(rank: int, world_size: int) -> Tuple[int, int]:
    """The sequence chunks a rank holds, in shard order."""
    return rank, 2 * world_size - 1 - rank


def _pairs(rank: int, src: int, world_size: int) -> List[Tuple[int, int, int, int]]:
    """(query half, key half, a, b) for every causal pair between rank's query chunks and the key
    chunks of rank src's shard: halves index the shards (0 = first C tokens), a and b are chunk ids."""
    pairs = []
    for ia, a in enumerate(_chunk_ids(rank, world_size)):
        for ib, b in enumerate(_chunk_ids(src, world_size)):
            if b <= a:
                pairs.append((ia, ib, a, b))
    return pairs


# ---- stats --------------------------------------------------------------------------------------

@dataclass
class RingAttentionStats:
    """Work realized by one context-parallel call (docs/spec.md, "Work accounting", summed over splits).

    fwd_slots / bwd_slots: int32 [B, Hq, 2C], this rank's rows in shard order: block_k for every
    retained tile of the row's query tile, summed over the pairs (splits) of the row.  The means,
    tile counts and fractions are over all ranks (all_reduce).  Backward fields stay None until the
    backward has run.
    """

    world_size: int
    chunk: int
    fwd_block_q: int
    fwd_block_k: int
    bwd_block_q: int
    bwd_block_k: int
    fwd_slots: torch.Tensor
    mean_fwd_slots: float
    fwd_retained_tiles: int
    fwd_legal_tiles: int
    bwd_slots: Optional[torch.Tensor] = None
    mean_bwd_slots: Optional[float] = None
    bwd_retained_tiles: Optional[int] = None
    bwd_legal_tiles: Optional[int] = None

    @property
    def fwd_retained_fraction(self) -> float:
        return self.fwd_retained_tiles / self.fwd_legal_tiles if self.fwd_legal_tiles else 1.0

    @property
    def bwd_retained_fraction(self) -> Optional[float]:
        if self.bwd_retained_tiles is None:
            return None
        return self.bwd_retained_tiles / self.bwd_legal_tiles if self.bwd_legal_tiles else 1.0

    def __repr__(self):
        parts = [f"world {self.world_size}", f"chunk {self.chunk}",
                 f"fwd tiles {self.fwd_block_q}x{self.fwd_block_k}", f"mean fwd slots {self.mean_fwd_slots:.1f}",
                 f"fwd retained {self.fwd_retained_fraction:.3f}"]
        if self.bwd_slots is not None:
            parts += [f"bwd tiles {self.bwd_block_q}x{self.bwd_block_k}", f"mean bwd slots {self.mean_bwd_slots:.1f}",
                      f"bwd retained {self.bwd_retained_fraction:.3f}"]
        return "RingAttentionStats(" + ", ".join(parts) + ")"


class _Work:
    """Per-rank work counters accumulated over the pairs of one pass."""

    def __init__(self, slots_shape, device):
        self.slots = [torch.zeros(slots_shape, dtype=torch.int32, device=device) for _ in range(2)]
        self.retained = torch.zeros((), dtype=torch.int64, device=device)
        self.legal = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, half, slots, mask):
        self.slots[half] += slots
        retained = (mask == TILE_RETAINED).sum()
        self.retained += retained
        self.legal += retained + (mask == TILE_SKIPPED).sum()

    def totals(self):
        """[slot sum, rows, retained tiles, legal tiles] as int64, for one all_reduce."""
        slots = torch.cat([s.flatten() for s in self.slots]).long()
        rows = torch.tensor(slots.numel(), dtype=torch.int64, device=slots.device)
        return torch.stack([slots.sum(), rows, self.retained, self.legal])


# ---- communication ------------------------------------------------------------------------------

class _Pending:
    """Tensors being received; wait() returns them once the transfers are complete."""

    def __init__(self, requests, received):
        self._requests, self._received = requests, received

    def wait(self):
        for request in self._requests:
            request.wait()
        return self._received


class _GroupComm:
    """The ring over a torch.distributed process group: this process is one rank.

    Every method takes and returns one entry per rank handled by this process (here one), so the
    same schedule code runs in a process group and in _LocalComm's single-process simulation.
    """

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        self.ranks = [rank]
        self._first = dist.get_global_rank(self.group, 0)
        self._next = dist.get_global_rank(self.group, (rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(self.group, (rank - 1) % self.world_size)

    def broadcast_from_first(self, tensors):
        """Group rank 0's tensor, on every rank (others pass a buffer of the same shape)."""
        dist.broadcast(tensors[0], src=self._first, group=self.group)
        return tensors

    def shift(self, tensors, kind):
        """Starts sending each of this rank's tensors to the next rank and receiving the previous
        rank's.  kind ("kv" or "grad") only matters to the benchmark's communication-free variant."""
        tensors = tensors[0]
        if self.world_size == 1:
            return _Pending([], [tensors])
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group) for t in received]
        return _Pending(dist.batch_isend_irecv(ops), [received])

    def sum(self, values):
        """Sum of each rank's tensor over the group (all ranks get it)."""
        total = values[0].clone()
        dist.all_reduce(total, group=self.group)
        return total


class _LocalComm:
    """All W ranks in this process, run in lockstep: a shift is a rotation of the per-rank lists.

    For single-GPU simulation (the benchmark's --single-process) and tests: the same schedule, the
    same operator calls, no communication.
    """

    def __init__(self, world_size):
        self.world_size = int(world_size)
        self.ranks = list(range(self.world_size))

    def broadcast_from_first(self, tensors):
        return [tensors[0]] * self.world_size

    def shift(self, tensors, kind):
        return _Pending([], [tensors[(r - 1) % self.world_size] for r in self.ranks])

    def sum(self, values):
        return torch.stack(values).sum(0)


# ---- the plan: tiles, scale, tau ----------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """Everything a pass needs besides the tensors and the ring (which gives the world size)."""
    chunk: int                 # C: tokens per chunk
    tau: float
    scale: float               # the softmax scale (for the seeds)
    scale_arg: float           # what the operators get (0 = 1/sqrt(d))
    fwd_block_q: int           # the forward tiles (resolved)
    fwd_block_k: int
    bwd_block_q: int           # the backward tiles (resolved)
    bwd_block_k: int
    fwd_tile_args: Tuple[int, int]  # what the operators get (0 = the implementation's)
    bwd_tile_args: Tuple[int, int]
    return_stats: bool
    deterministic: bool


def _check_inputs(q, k, v, causal):
    """Argument checks that need no process group (each error names its argument)."""
    if not causal:
        raise ValueError("causal: context-parallel MALA is causal only (got causal=False)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: must be a 4-D tensor [batch, 2 * chunk, heads, head_dim] (the local shard)")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[1] != q.shape[1] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k: shape {tuple(k.shape)} must match q's {tuple(q.shape)} in batch, tokens and head_dim "
                         "(each rank holds the same tokens of q, k and v)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"k: heads_kv = {k.shape[2]} must divide heads_q = {q.shape[2]}")
    if q.shape[1] % 2 or q.shape[1] == 0:
        raise ValueError(f"q: the local shard length {q.shape[1]} must be 2 * chunk (two zig-zag chunks), "
                         "so even and > 0")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device or t.dtype != q.dtype:
            raise ValueError(f"{name}: must have q's device and dtype ({q.device}, {q.dtype}); got "
                             f"({t.device}, {t.dtype})")


def _tiles(kernel, q, k, chunk, block_q, block_k, names):
    """(resolved tiles, operator arguments) of one kernel; the chunk must be a multiple of both.

    The seeds need the forward's query tiles (the newest-tile range is per query tile), so the
    resolved size is the one the operator will use: the caller's, or the implementation's.  The
    diagonal pair is causal and the others are not; both must use the same tiles.
    """
    for name, given in zip(names, (block_q, block_k)):
        if int(given) < 0:
            raise ValueError(f"{name}: must be >= 0, 0 meaning the implementation's {kernel} tile (got {given})")
    batch, heads_q, heads_kv, dim = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    resolved = []
    for causal in (True, False):
        bq, bk, _ = torch.ops.mala.tile_sizes(kernel, q.device, q.dtype, batch, chunk, chunk, heads_q, heads_kv,
                                              dim, causal, 0)
        resolved.append((int(block_q) or int(bq), int(block_k) or int(bk)))
    if resolved[0] != resolved[1]:
        raise ValueError(f"{names[0]}: the implementation's {kernel} tiles differ between the causal diagonal pair "
                         f"{resolved[0]} and the full pairs {resolved[1]}; pass {names[0]} and {names[1]}")
    for name, given, size in zip(names, (block_q, block_k), resolved[0]):
        if chunk % size:
            origin = "" if given else f" (the implementation's {kernel} tile)"
            raise ValueError(f"{name}: the chunk length C = {chunk} (the shard's {2 * chunk} tokens / 2) must be a "
                             f"multiple of {name} = {size}{origin}")
    return resolved[0], (int(block_q), int(block_k))


def _make_plan(q, k, tau, softmax_scale, tiles, return_stats, deterministic):
    chunk = q.shape[1] // 2
    block_q, block_k, bwd_block_q, bwd_block_k = tiles
    (fq, fk), fwd_args = _tiles("forward", q, k, chunk, block_q, block_k, ("block_q", "block_k"))
    (bq, bk), bwd_args = _tiles("backward", q, k, chunk, bwd_block_q, bwd_block_k, ("bwd_block_q", "bwd_block_k"))
    scale_arg = _scale_arg(softmax_scale)
    return _Plan(chunk=chunk, tau=_tau_arg(tau),
                 scale=scale_arg or 1.0 / math.sqrt(q.shape[3]), scale_arg=scale_arg,
                 fwd_block_q=fq, fwd_block_k=fk, bwd_block_q=bq, bwd_block_k=bk,
                 fwd_tile_args=fwd_args, bwd_tile_args=bwd_args, return_stats=bool(return_stats),
                 deterministic=bool(deterministic))


# ---- seeds: the exact mass of the anchor tiles --------------------------------------------------

_SEED_ELEMENTS = 1 << 24  # fp32 scores per block of the seed computation (bounds its temporaries)


def _log_mass(q, keys, legal, scale, heads_kv):
    """log sum_k exp(scale * q.k) over legal keys, fp32.

    q [B, R, T, Hq, d] (R blocks of T rows), keys [B, R, K, Hkv, d], legal [R, T, K] bool (shared by
    batch and heads) -> [B, Hq, R, T].
    """
    b, r, t, hq, d = q.shape
    g = hq // heads_kv
    scores = torch.einsum("brtkgd,brskd->bkgrts", q.float().view(b, r, t, heads_kv, g, d), keys.float())
    scores = (scores * scale).masked_fill(~legal, float("-inf"))
    return torch.logsumexp(scores, dim=-1).reshape(b, hq, r, t)


def _anchor_seeds(plan, q_half, k_diag, k_tile0):
    """(tile-0 mass, newest-range mass), fp32 [B, Hq, C] each, for the rows of a query chunk a > 0
    (q_half: its queries, k_diag: its keys, k_tile0: the sequence's key tile 0).

    Tile 0: every row of chunk a > 0 sees all of key tile 0.  Newest range: query tile i of the chunk
    (global rows a C + i Bq .. a C + (i+1) Bq - 1) has the anchors [newest(min L), newest(max L)],
    newest(L) = (L - 1) // Bk: the key tiles from (i Bq // Bk) Bk to its last row, all in chunk a
    because C is a multiple of both tiles.  A row's mass is over its legal keys (<= its position).
    """
    bq, bk, chunk = plan.fwd_block_q, plan.fwd_block_k, plan.chunk
    batch, _, heads_q, dim = q_half.shape
    heads_kv = k_diag.shape[2]
    n_tiles = chunk // bq
    window = bq + bk - 1  # keys from a query tile's first newest key to its last row
    tiles_per_block = max(1, min(n_tiles, _SEED_ELEMENTS // max(1, batch * heads_q * bq * window)))
    device = q_half.device
    tile0, newest = [], []
    t = torch.arange(bq, device=device)
    w = torch.arange(window, device=device)
    for first in range(0, n_tiles, tiles_per_block):
        tiles = torch.arange(first, min(n_tiles, first + tiles_per_block), device=device)
        q_blk = q_half[:, first * bq:(first + len(tiles)) * bq].reshape(batch, len(tiles), bq, heads_q, dim)
        # key tile 0: [B, 1, Bk] broadcast over the blocks, every key legal
        keys0 = k_tile0.unsqueeze(1).expand(-1, len(tiles), -1, -1, -1)
        legal0 = torch.ones((len(tiles), bq, bk), dtype=torch.bool, device=device)
        tile0.append(_log_mass(q_blk, keys0, legal0, plan.scale, heads_kv))
        # the newest range, in the chunk's local key indices
        start = (tiles * bq // bk) * bk                                   # [R]
        key_idx = start[:, None] + w[None, :]                             # [R, window]
        row_idx = tiles[:, None] * bq + t[None, :]                        # [R, T]
        legal = key_idx[:, None, :] <= row_idx[:, :, None]                # [R, T, window]
        keys = k_diag[:, key_idx.clamp(max=chunk - 1).flatten()].view(batch, len(tiles), window, heads_kv, dim)
        newest.append(_log_mass(q_blk, keys, legal, plan.scale, heads_kv))
    flat = lambda parts: torch.cat(parts, dim=2).reshape(batch, heads_q, chunk).contiguous()
    return flat(tile0), flat(newest)


class _Seeds:
    """The seed of each pair of a query chunk a: the log mass of the anchors the pair does not own."""

    def __init__(self, plan, q_half, k_diag, k_tile0, a):
        self.a = a
        if a > 0:
            self.tile0, self.newest = _anchor_seeds(plan, q_half, k_diag, k_tile0)
            self.both = torch.logaddexp(self.tile0, self.newest)

    def for_key_chunk(self, b):
        """None when the row's only split is this pair (a = 0): the plain forward rule."""
        if self.a == 0:
            return None
        if b == self.a:
            return self.tile0       # owns the newest tiles
        if b == 0:
            return self.newest      # owns key tile 0
        return self.both


# ---- forward ------------------------------------------------------------------------------------

def _merge(acc_out, acc_lse, out, lse):
    """lse-weighted combine of a running result with one split's; -inf rows get weight 0 (no NaN)."""
    new_lse = torch.logaddexp(acc_lse, lse)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    weight = lambda x: torch.exp(x - ref).transpose(1, 2).unsqueeze(-1)  # [B, Hq, C] -> [B, C, Hq, 1]
    return acc_out * weight(acc_lse) + out.float() * weight(lse), new_lse


def _forward(comm, plan, qs, ks, vs):
    """The forward ring for the ranks in comm.ranks (qs/ks/vs: one local shard per rank).

    Returns outs (input dtype), lses (fp32 [B, Hq, 2C] contiguous) and the per-rank _Work (or None).
    """
    world, chunk = comm.world_size, plan.chunk
    bk = plan.fwd_block_k
    # Key tile 0 of the sequence: the first Bk keys of rank 0's first chunk, broadcast once.
    tile0 = [k[:, :bk].contiguous() if r == 0 else
             torch.empty_like(k[:, :bk], memory_format=torch.contiguous_format) for r, k in zip(comm.ranks, ks)]
    tile0 = comm.broadcast_from_first(tile0)
    seeds, acc, work = [], [], []
    for r, q, k, k0 in zip(comm.ranks, qs, ks, tile0):
        ids = _chunk_ids(r, world)
        seeds.append([_Seeds(plan, q[:, h * chunk:(h + 1) * chunk], k[:, h * chunk:(h + 1) * chunk], k0, ids[h])
                      for h in range(2)])
        batch, _, heads_q, dim = q.shape
        acc.append([[torch.zeros((batch, chunk, heads_q, dim), dtype=torch.float32, device=q.device),
                     torch.full((batch, heads_q, chunk), float("-inf"), dtype=torch.float32, device=q.device)]
                    for _ in range(2)])
        work.append(_Work((batch, heads_q, chunk), q.device) if plan.return_stats else None)

    kv = [(k, v) for k, v in zip(ks, vs)]
    bq_arg, bk_arg = plan.fwd_tile_args
    for step in range(world):
        pending = comm.shift(kv, "kv") if step + 1 < world else None  # the next shard, during compute
        for i, r in enumerate(comm.ranks):
            k, v = kv[i]
            for ia, ib, a, b in _pairs(r, (r - step) % world, world):
                q_a = qs[i][:, ia * chunk:(ia + 1) * chunk]
                k_b, v_b = k[:, ib * chunk:(ib + 1) * chunk], v[:, ib * chunk:(ib + 1) * chunk]
                seed = seeds[i][ia].for_key_chunk(b)  # the owner flags only apply to a seeded split
                out, lse, slots, mask = torch.ops.mala.fwd_split(
                    q_a, k_b, v_b, seed, a * chunk, seed is not None and b == 0, seed is not None and b == a,
                    plan.tau, b == a, plan.scale_arg, bq_arg, bk_arg, plan.return_stats)
                acc[i][ia] = list(_merge(acc[i][ia][0], acc[i][ia][1], out, lse))
                if work[i] is not None:
                    work[i].add(ia, slots, mask)
        if pending is not None:
            kv = pending.wait()

    outs = [torch.cat([acc_out for acc_out, _ in halves], dim=1).to(q.dtype) for halves, q in zip(acc, qs)]
    lses = [torch.cat([acc_lse for _, acc_lse in halves], dim=2).contiguous() for halves in acc]
    return outs, lses, work


# ---- backward -----------------------------------------------------------------------------------

def _backward(comm, plan, qs, ks, vs, outs, lses, douts):
    """The backward ring: returns dqs, dks, dvs (input dtype) and the per-rank _Work (or None)."""
    world, chunk = comm.world_size, plan.chunk
    bq_arg, bk_arg = plan.bwd_tile_args
    dqs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in qs]
    work = [_Work((q.shape[0], q.shape[2], chunk), q.device) if plan.return_stats else None for q in qs]
    # The pairs read q, out, dout and lse per query chunk; lse must be contiguous per chunk.
    lse_halves = [[lse[..., h * chunk:(h + 1) * chunk].contiguous() for h in range(2)] for lse in lses]

    kv = [(k, v) for k, v in zip(ks, vs)]
    grads_pending = None  # the running (dk, dv) of the shard held next, coming from the previous rank
    for step in range(world):
        kv_pending = comm.shift(kv, "kv") if step + 1 < world else None
        contributions = []
        for i, r in enumerate(comm.ranks):
            k, v = kv[i]
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for ia, ib, a, b in _pairs(r, (r - step) % world, world):
                rows, keys = slice(ia * chunk, (ia + 1) * chunk), slice(ib * chunk, (ib + 1) * chunk)
                dq_p, dk_p, dv_p, slots, mask = torch.ops.mala.bwd_split(
                    douts[i][:, rows], qs[i][:, rows], k[:, keys], v[:, keys], outs[i][:, rows], lse_halves[i][ia],
                    a * chunk, plan.tau, b == a, plan.scale_arg, bq_arg, bk_arg, plan.return_stats,
                    plan.deterministic)
                dqs[i][:, rows] += dq_p
                dk[:, keys] += dk_p
                dv[:, keys] += dv_p
                if work[i] is not None:
                    work[i].add(ia, slots, mask)
            contributions.append((dk, dv))
        if grads_pending is not None:  # add what the previous ranks accumulated for this shard
            incoming = grads_pending.wait()
            contributions = [(dk + dk_in, dv + dv_in) for (dk, dv), (dk_in, dv_in) in zip(contributions, incoming)]
        grads_pending = comm.shift(contributions, "grad")  # overlaps the next step's compute
        if kv_pending is not None:
            kv = kv_pending.wait()
    home = grads_pending.wait()  # after W shifts each rank's own dk, dv
    dqs = [dq.to(q.dtype) for dq, q in zip(dqs, qs)]
    dks = [dk.to(k.dtype) for (dk, _), k in zip(home, ks)]
    dvs = [dv.to(v.dtype) for (_, dv), v in zip(home, vs)]
    return dqs, dks, dvs, work


# ---- autograd and the public function -----------------------------------------------------------

def _reduce_work(comm, work):
    """(mean slots per query, retained tiles, legal tiles) over all ranks."""
    slot_sum, rows, retained, legal = comm.sum([w.totals() for w in work]).tolist()
    return (slot_sum / rows if rows else 0.0), int(retained), int(legal)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, plan, stats_box):
        (out,), (lse,), work = _forward(comm, plan, [q], [k], [v])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.plan, ctx.stats_box = comm, plan, stats_box
        ctx.mark_non_differentiable(lse)
        if plan.return_stats:
            mean, retained, legal = _reduce_work(comm, work)
            stats_box.append(RingAttentionStats(
                world_size=comm.world_size, chunk=plan.chunk, fwd_block_q=plan.fwd_block_q,
                fwd_block_k=plan.fwd_block_k, bwd_block_q=plan.bwd_block_q, bwd_block_k=plan.bwd_block_k,
                fwd_slots=torch.cat(work[0].slots, dim=2), mean_fwd_slots=mean, fwd_retained_tiles=retained,
                fwd_legal_tiles=legal))
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        # dout may be expanded (out.sum().backward()): the pairs slice it by rows.
        (dq,), (dk,), (dv,), work = _backward(ctx.comm, plan, [q], [k], [v], [out], [lse], [dout.contiguous()])
        if plan.return_stats:
            stats = ctx.stats_box[0]
            stats.mean_bwd_slots, stats.bwd_retained_tiles, stats.bwd_legal_tiles = _reduce_work(ctx.comm, work)
            stats.bwd_slots = torch.cat(work[0].slots, dim=2)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, tau: float = 1.0,
              softmax_scale: Optional[float] = None, causal: bool = True, return_lse: bool = False,
              return_stats: bool = False, block_q: int = 0, block_k: int = 0, bwd_block_q: int = 0,
              bwd_block_k: int = 0, deterministic: bool = False):
    """Context-parallel causal MALA over the ranks of `group` (default: the world).

    q [B, 2C, Hq, d], k, v [B, 2C, Hkv, d]: this rank's zig-zag shard (zigzag_shard), the same
    shapes on every rank.  Returns this rank's out [B, 2C, Hq, d], then lse [B, Hq, 2C] float32
    (global natural-log normalizer, non-differentiable) if return_lse, then a RingAttentionStats if
    return_stats.  Differentiable in q, k, v (every rank must run the backward).

    Causal only: causal=False raises ValueError.  tau and softmax_scale as mala.attention.
    block_q/block_k (forward) and bwd_block_q/bwd_block_k (backward): the tiles, 0 = the
    implementation's; the CPU implementation accepts any, CUDA only its own.  C must be a multiple of
    all four (the chunks are then tile-aligned, which the anchor rule needs).  deterministic as for
    mala.attention (bit-identical backward for a fixed world size).
    """
    _check_inputs(q, k, v, causal)
    plan = _make_plan(q, k, tau, softmax_scale, (block_q, block_k, bwd_block_q, bwd_block_k), return_stats,
                      deterministic)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call torch.distributed.init_process_group)")
    comm = _GroupComm(group)
    stats_box = []
    out, lse = _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, plan, stats_box)
    result = (out,) + ((lse,) if return_lse else ()) + ((stats_box[0],) if return_stats else ())
    return result if len(result) > 1 else out

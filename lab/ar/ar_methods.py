"""The attention methods of the associative-recall study (issue #65), one module per layer.

Every method takes q, k, v [B, N, H, d] (rotary already applied), the layer's input x [B, N, D] (for
the methods with their own selectors or gates) and `rope` (the model's rotary map, for the DSA
indexer), and returns out [B, N, H, d].  After each forward it leaves
  last_slots  mean post-score key slots per query row (over batch, heads, rows) as a float tensor
  aux         an auxiliary loss to add to the task loss (DSA's indexer), or None
  last_stats  mala's AttentionStats (mala only; backward slots appear once backward has run)

  full  dense causal attention (torch SDPA)
  mala  mala.attention(tau) forward and backward; no ceiling, its slots are what the rule realizes
  swa   causal sliding window of `ceiling` keys
  moba  MoBA (Lu et al., Moonshot AI, 2025): keys in blocks of moba_block, each block scored per
        head by q . mean-pooled key of the block; the current block always, plus the top
        (ceiling / moba_block - 1) past blocks; causal inside the current block
  dsa   DeepSeek sparse attention (DeepSeek-V3.2): a lightweight indexer
        I(t, s) = sum_j w(t, j) * relu(q_I(t, j) . k_I(s)) scores every past key; the top `ceiling`
        keys per token, shared by every head, are attended.  The indexer's input is detached and it
        learns only from a KL loss towards the main attention's head-mean distribution over the
        selected keys (the paper's sparse training stage); there is no dense warm-up stage, since
        the models here train from scratch with the indexer in place.
  nsa   native sparse attention: fla-core 0.6.0's parallel_nsa (Triton, CUDA only, imported
        lazily) computes the compressed and selected branches; the sliding branch (nsa_window keys)
        is swa's kernel here, since parallel_nsa's own calls flash-attn, absent on the GPU machine.
        The gated sum is fla's: o_slc * g_slc + o_cmp * g_cmp + o_swa * g_swa, learned sigmoid gates.

swa, moba and dsa select in PyTorch and attend through flex_attention: a mask_mod reads the
selection, and a BlockMask of TILE x TILE tiles lists the tiles any allowed (row, key) pair falls in,
so the kernel (flex_attention under torch.compile on CUDA) skips the rest.  MoBA and DSA select per
row, so a tile runs when any of its rows chose a key in it: their cost lies between the ceiling's
and dense causal attention's, never the dense masked scores that an 8K sequence cannot afford.
flex_attention has no CPU backward, so on the CPU the same mask_mod is materialized into a boolean
mask for SDPA; the tests check the two against each other and each selection against brute force.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention
from torch.utils.checkpoint import checkpoint

METHODS = ("full", "mala", "swa", "moba", "dsa", "nsa")
NSA_GROUP = 16  # parallel_nsa asserts HQ / H is a power of 2 and >= 16
TILE = 128      # rows and keys of one BlockMask tile: flex_attention's default sparse block


@dataclass(frozen=True)
class MethodConfig:
    ceiling: int = 1024        # nominal post-score key slots per query, after causal clipping
    tau: float = 1.0           # mala
    moba_block: int = 128      # moba: ceiling / moba_block blocks, the current one included
    dsa_heads: int = 4         # dsa indexer heads
    dsa_dim: int = 32          # dsa indexer head dim
    dsa_kl_weight: float = 1.0
    nsa_block: int = 64        # nsa: selection block (and compression block) size
    nsa_window: int = 128      # nsa: sliding window; selection gets the rest of the ceiling
    chunk_elems: int = 1 << 27  # score elements per query chunk of dsa's indexer and KL target

    @property
    def moba_topk(self) -> int:
        if self.ceiling % self.moba_block:
            raise ValueError(f"moba: ceiling {self.ceiling} is not a multiple of moba_block {self.moba_block}")
        return self.ceiling // self.moba_block

    @property
    def nsa_blocks(self) -> int:
        n = (self.ceiling - self.nsa_window) // self.nsa_block
        if n < 1:
            raise ValueError(f"nsa: ceiling {self.ceiling} leaves no selection block after window {self.nsa_window}")
        return n

    def to_dict(self):
        d = asdict(self)
        d.update(moba_topk=self.moba_topk, nsa_blocks=self.nsa_blocks)
        return d


class Unavailable(RuntimeError):
    """A method that cannot run here (nsa without fla-core, Triton or CUDA)."""


def available(method: str, device) -> tuple[bool, str]:
    """(True, "") or (False, the reason) for running `method` on `device`."""
    if method not in METHODS:
        return False, f"unknown method {method!r} (one of {', '.join(METHODS)})"
    if method == "nsa":
        if torch.device(device).type != "cuda":
            return False, "nsa: fla-core 0.6.0's parallel_nsa is a Triton kernel and runs on CUDA only"
        try:
            _parallel_nsa()
        except Unavailable as e:
            return False, str(e)
    if method == "mala":
        try:
            import mala  # noqa: F401
        except ImportError as e:
            return False, f"mala: the extension does not import ({e})"
    return True, ""


def _parallel_nsa():
    try:
        from fla.ops.nsa import parallel_nsa
    except Exception as e:  # ImportError, or Triton failing to initialize without a GPU
        raise Unavailable(f"nsa: needs fla-core==0.6.0 with Triton (pip install fla-core==0.6.0): {e}") from e
    return parallel_nsa


# ---------------------------------------------------------------------------------------------
# Sparse attention through flex_attention.  A selection is a mask_mod (b, h, q_idx, kv_idx) -> bool
# over buffers padded to whole tiles (so that no index of a kernel's last tile reads past them),
# plus, for the kernel, the counts of allowed pairs per tile that its BlockMask lists.

_flex_compiled = None


def _flex(q):
    """flex_attention compiled once per process on CUDA (uncompiled it materializes every score);
    eager on the CPU, where it has no backward and serves the forward-only tests."""
    global _flex_compiled
    if not q.is_cuda:
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def sparse_attention(q, k, v, mask_mod, mask_dims, block_mask, impl):
    """Softmax attention of q [B, N, H, d] over the keys that mask_mod allows; out [B, N, H, d].
    mask_dims: the mask's (batch, heads), 1 where it is shared.  impl "flex": flex_attention with
    block_mask() (a callable, so that the dense path never builds it); "dense": the mask
    materialized for SDPA, the CPU's path (flex_attention has no CPU backward)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if impl == "flex":
        bm = block_mask()
        with torch.autocast(q.device.type, enabled=False):  # q, k, v come in their compute dtype
            out = _flex(q)(qt, kt, vt, block_mask=bm)
    elif impl == "dense":
        n = q.shape[1]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=create_mask(mask_mod, *mask_dims, n, n, q.device))
    else:
        raise ValueError(f"impl {impl!r}: flex or dense")
    return out.transpose(1, 2)


def padded(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def _ordered(tiles):
    """BlockMask's layout of a boolean tile map [..., nq, nk]: per row of tiles, the count of True
    tiles and their indices first."""
    t = tiles.to(torch.int8)
    idx = torch.argsort(t, dim=-1, descending=True, stable=True)
    return t.sum(-1, dtype=torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def block_mask_from_counts(counts, n: int, tile: int, mask_mod) -> BlockMask:
    """A BlockMask from counts [Bm, Hm, nq, nk] of allowed (row, key) pairs per tile: full tiles
    (every pair allowed, so the kernel skips mask_mod there), partial ones (mask_mod applies), and
    no entry for empty tiles.  A tile cut by the sequence end is never full, as in
    create_block_mask."""
    full = counts == tile * tile
    pn, pi = _ordered((counts > 0) & ~full)
    fn, fi = _ordered(full)
    return BlockMask.from_kv_blocks(pn, pi, fn, fi, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(n, n))


def causal_allow(r0: int, r1: int, n: int, device) -> torch.Tensor:
    """[c, n]: key j <= row i, rows r0 .. r1 - 1."""
    i = torch.arange(r0, r1, device=device)[:, None]
    return torch.arange(n, device=device)[None, :] <= i


# -- swa ------------------------------------------------------------------------------------------

def swa_mask_mod(window: int):
    def mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    return mod


@functools.lru_cache(maxsize=16)
def swa_block_mask(n: int, window: int, device, tile: int = TILE) -> BlockMask:
    return create_block_mask(swa_mask_mod(window), None, None, n, n, device=device, BLOCK_SIZE=tile)


def swa_mean_slots(n: int, window: int) -> float:
    return float(torch.clamp(torch.arange(1, n + 1, dtype=torch.float64), max=window).mean())


# -- moba -----------------------------------------------------------------------------------------

def block_means(k: torch.Tensor, block: int) -> torch.Tensor:
    """[B, nb, H, d]: the mean of each block of keys (the last one over the keys it has)."""
    B, n, H, d = k.shape
    nb = -(-n // block)
    pad = nb * block - n
    kp = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).view(B, nb, block, H, d)
    counts = torch.full((nb,), float(block), device=k.device)
    counts[-1] = block - pad
    return kp.sum(2) / counts[None, :, None, None]


def moba_gate(q: torch.Tensor, kmean: torch.Tensor) -> torch.Tensor:
    """[B, H, N, nb]: q . mean-pooled key of every block."""
    return torch.einsum("bchd,bkhd->bhck", q.float(), kmean)


def moba_select(q: torch.Tensor, k: torch.Tensor, block: int, topk: int) -> torch.Tensor:
    """[B, H, N, nb] bool: the key blocks each row attends, its own block plus the top (topk - 1)
    past blocks by gate score.  The routing is not differentiated, as in MoBA."""
    gate = moba_gate(q.detach(), block_means(k.detach(), block))
    n, nb, dev = q.shape[1], gate.shape[-1], q.device
    cur = (torch.arange(n, device=dev) // block)[:, None]
    b = torch.arange(nb, device=dev)[None, :]
    s = gate.masked_fill(b > cur, float("-inf")).masked_fill(b == cur, float("inf"))
    idx = s.topk(min(topk, nb), dim=-1).indices
    return torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & (b <= cur)


def moba_mask_mod(sel: torch.Tensor, block: int, tile: int = TILE):
    """Key kv of row q: its block is selected, and kv <= q."""
    n, nb = sel.shape[2], sel.shape[3]
    npad = padded(n, tile)
    sel = F.pad(sel, (0, -(-npad // block) - nb, 0, npad - n))

    def mod(b, h, q_idx, kv_idx):
        return sel[b, h, q_idx, kv_idx // block] & (kv_idx <= q_idx)
    return mod


def _segment_keys(n: int, seg: int, device) -> torch.Tensor:
    """[N, ceil(N / seg)]: the keys of each segment of `seg` keys at or before each row."""
    i = torch.arange(n, device=device)[:, None]
    start = torch.arange(-(-n // seg), device=device)[None, :] * seg
    return (i + 1 - start).clamp(0, seg)


def moba_slots(sel: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over (batch, head, row) of the causal keys of the selected blocks."""
    per_row = (sel.float() * _segment_keys(sel.shape[2], block, sel.device).float()).sum(-1)  # exact: <= N
    return per_row.double().mean().float()


def moba_tile_counts(sel: torch.Tensor, block: int, tile: int = TILE) -> torch.Tensor:
    """[B, H, nq, nk]: allowed (row, key) pairs per tile.  Keys go in segments of gcd(block, tile),
    each inside one block and one tile; counts are integers below 2^24, exact in float32."""
    B, H, n, _ = sel.shape
    g = math.gcd(block, tile)
    cnt = _segment_keys(n, g, sel.device)
    seg_block = torch.arange(cnt.shape[1], device=sel.device) * g // block
    w = sel[..., seg_block].float() * cnt.float()
    npad = padded(n, tile)
    nk = npad // tile
    w = F.pad(w, (0, nk * (tile // g) - cnt.shape[1], 0, npad - n))
    return w.view(B, H, npad // tile, tile, nk, tile // g).sum((3, 5))


# -- dsa ------------------------------------------------------------------------------------------

def dsa_index_scores(qi_rows: torch.Tensor, ki: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """[B, c, n]: I(t, s) = sum_j w(t, j) relu(q_I(t, j) . k_I(s)); qi_rows [B, c, HI, dI],
    ki [B, n, dI], w_rows [B, c, HI]."""
    dots = torch.einsum("bcjd,bnd->bcjn", qi_rows.float(), ki.float())
    return torch.einsum("bcj,bcjn->bcn", w_rows.float(), F.relu(dots))


def dsa_topk(scores: torch.Tensor, r0: int, topk: int):
    """(idx, valid), both [B, c, min(topk, n)]: each row's top-k keys by indexer score among its past
    keys; valid is False for the picks beyond the causal limit (rows with fewer than topk past keys
    take every past key)."""
    c, n, dev = scores.shape[1], scores.shape[2], scores.device
    rows = torch.arange(r0, r0 + c, device=dev)[:, None]
    s = scores.masked_fill(torch.arange(n, device=dev)[None, :] > rows, float("-inf"))
    idx = s.topk(min(topk, n), dim=-1).indices
    return idx, idx <= rows


def dsa_pack(idx: torch.Tensor, valid: torch.Tensor, n_words: int) -> torch.Tensor:
    """[B, c, n_words] int32 bitsets of the valid picks: key j is bit j % 32 of word j // 32.  A row's
    picks are distinct, so their bits add without carries; an 8K x 8K selection per sequence takes
    8 MiB instead of a boolean mask's 64."""
    one = torch.ones_like(idx)
    bits = torch.where(valid, one << (idx & 31), 0 * one)
    w = torch.zeros(*idx.shape[:-1], n_words, dtype=torch.int64, device=idx.device).scatter_add_(-1, idx >> 5, bits)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)  # two's complement, no overflow


def dsa_mask_mod(words: torch.Tensor):
    def mod(b, h, q_idx, kv_idx):
        return ((words[b, q_idx, kv_idx >> 5] >> (kv_idx & 31)) & 1) == 1
    return mod


def dsa_add_tile_counts(counts: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, r0: int, tile: int):
    """counts [B, 1, nq, nk] += the valid picks of rows r0 .. per tile."""
    B, c, _ = idx.shape
    nq, nk = counts.shape[-2:]
    dev = idx.device
    qt = (torch.arange(r0, r0 + c, device=dev) // tile)[None, :, None]
    flat = (torch.arange(B, device=dev)[:, None, None] * nq + qt) * nk + idx // tile
    counts.view(-1).scatter_add_(0, flat.reshape(-1), valid.reshape(-1).to(counts.dtype))


def chunk_rows(cfg: MethodConfig, B: int, H: int, n: int) -> int:
    return max(1, min(n, cfg.chunk_elems // max(1, B * H * n)))


# ---------------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, method: str, d_model: int, n_heads: int, head_dim: int, cfg: MethodConfig = MethodConfig()):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method {method!r}: one of {', '.join(METHODS)}")
        self.method, self.cfg, self.n_heads, self.head_dim = method, cfg, n_heads, head_dim
        self.last_slots, self.aux, self.last_stats = None, None, None
        self.chunk = None  # dsa's rows per chunk; None: from cfg.chunk_elems
        self.impl = None   # sparse_attention's path; None: flex on CUDA, dense elsewhere
        self.tile = TILE
        if method == "dsa":
            self.iq = nn.Linear(d_model, cfg.dsa_heads * cfg.dsa_dim, bias=False)
            self.ik = nn.Linear(d_model, cfg.dsa_dim, bias=False)
            self.iw = nn.Linear(d_model, cfg.dsa_heads, bias=False)
        if method == "nsa":
            self.gate = nn.Linear(d_model, 3 * n_heads)

    def forward(self, q, k, v, x, rope):
        self.aux, self.last_stats = None, None
        fn = getattr(self, "_" + self.method)
        return fn(q, k, v, x, rope)

    def _impl(self, q):
        return self.impl or ("flex" if q.is_cuda else "dense")

    # -- dense and mala -------------------------------------------------------------------------
    def _full(self, q, k, v, x, rope):
        n = q.shape[1]
        self.last_slots = torch.tensor((n + 1) / 2.0)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    def _mala(self, q, k, v, x, rope):
        import mala

        dt = q.dtype
        if q.is_cuda and dt == torch.float32:  # the CUDA kernels take float16/bfloat16
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        out, stats = mala.attention(q.contiguous(), k.contiguous(), v.contiguous(), tau=self.cfg.tau,
                                    causal=True, return_stats=True)
        self.last_stats = stats
        self.last_slots = torch.tensor(float(stats.mean_fwd_slots))
        return out.to(dt)

    # -- block-sparse baselines -----------------------------------------------------------------
    def _window(self, q, k, v, window):
        n, tile = q.shape[1], self.tile
        return sparse_attention(q, k, v, swa_mask_mod(window), (1, 1),
                                lambda: swa_block_mask(n, window, q.device, tile), self._impl(q))

    def _swa(self, q, k, v, x, rope):
        self.last_slots = torch.tensor(swa_mean_slots(q.shape[1], self.cfg.ceiling))
        return self._window(q, k, v, self.cfg.ceiling)

    def _moba(self, q, k, v, x, rope):
        B, n, H, _ = q.shape
        blk, tile = self.cfg.moba_block, self.tile
        sel = moba_select(q, k, blk, self.cfg.moba_topk)
        self.last_slots = moba_slots(sel, blk).detach()
        mod = moba_mask_mod(sel, blk, tile)
        bm = lambda: block_mask_from_counts(moba_tile_counts(sel, blk, tile), n, tile, mod)  # noqa: E731
        return sparse_attention(q, k, v, mod, (B, H), bm, self._impl(q))

    def _dsa_chunk(self, r0, q_rows, k, qi_rows, ki, wi_rows):
        """(KL sum, idx, valid) of rows r0 ..: the indexer's top-k selection (dsa_topk) and the KL
        from the main attention's head-mean distribution over it (a target: q_rows and k come
        detached) to the indexer's own."""
        scores = dsa_index_scores(qi_rows, ki, wi_rows)
        idx, valid = dsa_topk(scores.detach(), r0, self.cfg.ceiling)
        with torch.no_grad():
            s = torch.einsum("bchd,bnhd->bhcn", q_rows.float(), k.float()) / math.sqrt(q_rows.shape[-1])
            s = s.gather(-1, idx[:, None].expand(-1, s.shape[1], -1, -1)).masked_fill(~valid[:, None], float("-inf"))
            target = torch.softmax(s, dim=-1).mean(1)  # [B, c, K], zero at the invalid picks
        logq = torch.log_softmax(scores.gather(-1, idx).masked_fill(~valid, float("-inf")), dim=-1)
        kl = (target * (torch.log(target.clamp_min(1e-30)) - logq.masked_fill(~valid, 0.0))).sum()
        return kl, idx, valid

    def _dsa(self, q, k, v, x, rope):
        B, n, H, _ = q.shape
        cfg, tile, impl = self.cfg, self.tile, self._impl(q)
        xd = x.detach()  # the indexer learns only from its KL loss
        qi = rope(self.iq(xd).view(B, n, cfg.dsa_heads, cfg.dsa_dim)) * cfg.dsa_dim ** -0.5
        ki = rope(self.ik(xd).view(B, n, 1, cfg.dsa_dim))[:, :, 0]
        wi = self.iw(xd) * cfg.dsa_heads ** -0.5
        npad = padded(n, tile)
        n_words = -(-npad // 32)
        words = torch.zeros(B, npad, n_words, dtype=torch.int32, device=q.device)
        counts = (torch.zeros(B, 1, npad // tile, npad // tile, dtype=torch.int32, device=q.device)
                  if impl == "flex" else None)
        # The indexer's [B, c, HI, n] scores and the target's [B, H, c, n] go chunk by chunk, each
        # recomputed in backward instead of kept: an 8K sequence cannot hold them whole.
        c = self.chunk or chunk_rows(cfg, B, max(H, cfg.dsa_heads), n)
        grad = torch.is_grad_enabled() and qi.requires_grad
        qd, kd = q.detach(), k.detach()
        kl, picks = 0.0, 0
        for r0 in range(0, n, c):
            args = (r0, qd[:, r0:r0 + c], kd, qi[:, r0:r0 + c], ki, wi[:, r0:r0 + c])
            if grad:
                kl_c, idx, valid = checkpoint(self._dsa_chunk, *args, use_reentrant=False)
            else:
                kl_c, idx, valid = self._dsa_chunk(*args)
            words[:, r0:r0 + idx.shape[1]] = dsa_pack(idx, valid, n_words)
            if counts is not None:
                dsa_add_tile_counts(counts, idx, valid, r0, tile)
            kl = kl + kl_c
            picks = picks + valid.sum()
        self.last_slots = (picks / (B * n)).float().detach()  # every head attends the row's picks
        self.aux = cfg.dsa_kl_weight * kl / (B * n)
        mod = dsa_mask_mod(words)
        return sparse_attention(q, k, v, mod, (B, 1), lambda: block_mask_from_counts(counts, n, tile, mod), impl)

    # -- nsa through fla-core -------------------------------------------------------------------
    def _nsa(self, q, k, v, x, rope):
        parallel_nsa = _parallel_nsa()
        B, n, H, d = q.shape
        cfg, in_dt = self.cfg, q.dtype
        dt = torch.bfloat16 if in_dt == torch.float32 else in_dt
        q, k, v = q.to(dt), k.to(dt).contiguous(), v.to(dt).contiguous()
        # Each model head becomes one KV head with NSA_GROUP identical query heads: the kernel's
        # group-shared block selection is then exactly per head, and the model stays the same as
        # every other method's (the group's outputs are identical; the first one is kept).
        g_cmp, g_slc, g_swa = torch.sigmoid(self.gate(x)).to(dt).split(H, dim=-1)
        rep = lambda t: t.repeat_interleave(NSA_GROUP, dim=2).contiguous()  # noqa: E731
        o = parallel_nsa(rep(q), k, v, rep(g_cmp), rep(g_slc), None, block_counts=cfg.nsa_blocks,
                         block_size=cfg.nsa_block, window_size=0)
        o = o.view(B, n, H, NSA_GROUP, d)[:, :, :, 0]
        if cfg.nsa_window > 0:  # fla's sliding term: causal window of nsa_window keys, scale 1/sqrt(d)
            o = torch.addcmul(o, self._window(q, k, v, cfg.nsa_window), g_swa.unsqueeze(-1))
        self.last_slots = torch.tensor(nsa_nominal_slots(n, cfg))
        return o.to(in_dt)


def nsa_nominal_slots(n: int, cfg: MethodConfig) -> float:
    """Mean over rows of min(i + 1, selected blocks * block) + min(i + 1, window): the selected and
    sliding branches' token slots after causal clipping (parallel_nsa does not return its block
    choices, so selection counts as full; the compressed branch's (i + 1) // block block summaries
    are reported apart by nsa_compressed_slots)."""
    i = torch.arange(n, dtype=torch.float64)
    sel = torch.clamp(i + 1, max=cfg.nsa_blocks * cfg.nsa_block)
    win = torch.clamp(i + 1, max=cfg.nsa_window)
    return float((sel + win).mean())


def nsa_compressed_slots(n: int, cfg: MethodConfig) -> float:
    return float((torch.arange(1, n + 1, dtype=torch.float64) // cfg.nsa_block).mean())

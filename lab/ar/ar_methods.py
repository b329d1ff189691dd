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
        learns only from a KL loss towards the main attention's head-summed distribution over the
        selected keys (the paper's sparse training stage); there is no dense warm-up stage, since
        the models here train from scratch with the indexer in place.
  nsa   native sparse attention through fla-core 0.6.0's parallel_nsa (Triton, CUDA only), imported
        lazily; compressed, selected and sliding branches with learned sigmoid gates

The fixed-budget baselines (swa, moba, dsa) are written with explicit boolean masks over query
chunks, in float32: correctness over speed.  Each chunk runs under activation checkpointing when
gradients are needed, so an 8K sequence never holds all of its N x N scores at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

METHODS = ("full", "mala", "swa", "moba", "dsa", "nsa")
NSA_GROUP = 16  # parallel_nsa asserts HQ / H is a power of 2 and >= 16


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
    chunk_elems: int = 1 << 27  # score elements per query chunk of the masked baselines

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
# Selections: boolean masks of the keys each query row of a chunk attends to.  The tests compare
# each with a brute-force reference built from the same scores.

def causal_allow(r0: int, r1: int, n: int, device) -> torch.Tensor:
    """[c, n]: key j <= row i, rows r0 .. r1 - 1."""
    i = torch.arange(r0, r1, device=device)[:, None]
    return torch.arange(n, device=device)[None, :] <= i


def swa_allow(r0: int, r1: int, n: int, window: int, device) -> torch.Tensor:
    """[c, n]: i - window < j <= i."""
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j <= i) & (j > i - window)


def block_means(k: torch.Tensor, block: int) -> torch.Tensor:
    """[B, nb, H, d]: the mean of each block of keys (the last one over the keys it has)."""
    B, n, H, d = k.shape
    nb = -(-n // block)
    pad = nb * block - n
    kp = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).view(B, nb, block, H, d)
    counts = torch.full((nb,), float(block), device=k.device)
    counts[-1] = block - pad
    return kp.sum(2) / counts[None, :, None, None]


def moba_gate(q_rows: torch.Tensor, kmean: torch.Tensor) -> torch.Tensor:
    """[B, H, c, nb]: q . mean-pooled key of every block."""
    return torch.einsum("bchd,bkhd->bhck", q_rows.float(), kmean)


def moba_allow(gate: torch.Tensor, r0: int, n: int, block: int, topk: int) -> torch.Tensor:
    """[B, H, c, n] from gate scores [B, H, c, nb]: the current block plus the top (topk - 1) past
    blocks by score, keys causal."""
    c, nb = gate.shape[2], gate.shape[3]
    dev = gate.device
    cur = (torch.arange(r0, r0 + c, device=dev) // block)[:, None]
    b = torch.arange(nb, device=dev)[None, :]
    s = gate.masked_fill(b > cur, float("-inf")).masked_fill(b == cur, float("inf"))
    kk = min(topk, nb)
    idx = s.topk(kk, dim=-1).indices
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & (b <= cur)
    keys_block = torch.arange(n, device=dev) // block
    return chosen[..., keys_block] & causal_allow(r0, r0 + c, n, dev)


def dsa_index_scores(qi_rows: torch.Tensor, ki: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """[B, c, n]: I(t, s) = sum_j w(t, j) relu(q_I(t, j) . k_I(s)); qi_rows [B, c, HI, dI],
    ki [B, n, dI], w_rows [B, c, HI]."""
    dots = torch.einsum("bcjd,bnd->bcjn", qi_rows.float(), ki.float())
    return torch.einsum("bcj,bcjn->bcn", w_rows.float(), F.relu(dots))


def dsa_allow(scores: torch.Tensor, r0: int, topk: int) -> torch.Tensor:
    """[B, c, n]: the top-k past keys of each row by indexer score (all of them when fewer)."""
    c, n = scores.shape[1], scores.shape[2]
    causal = causal_allow(r0, r0 + c, n, scores.device)
    s = scores.masked_fill(~causal, float("-inf"))
    idx = s.topk(min(topk, n), dim=-1).indices
    return torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & causal


# ---------------------------------------------------------------------------------------------

def masked_chunk(q_rows, k, v, allow, scale):
    """Softmax attention of a chunk of rows over the allowed keys.  q_rows [B, c, H, d], allow
    broadcastable to [B, H, c, n].  Returns out [B, c, H, d] (float32) and probs [B, H, c, n]."""
    s = torch.einsum("bchd,bnhd->bhcn", q_rows.float(), k.float()) * scale
    p = torch.softmax(s.masked_fill(~allow, float("-inf")), dim=-1)
    return torch.einsum("bhcn,bnhd->bchd", p, v.float()), p


def chunk_rows(cfg: MethodConfig, B: int, H: int, n: int) -> int:
    return max(1, min(n, cfg.chunk_elems // max(1, B * H * n)))


class Attention(nn.Module):
    def __init__(self, method: str, d_model: int, n_heads: int, head_dim: int, cfg: MethodConfig = MethodConfig()):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method {method!r}: one of {', '.join(METHODS)}")
        self.method, self.cfg, self.n_heads, self.head_dim = method, cfg, n_heads, head_dim
        self.last_slots, self.aux, self.last_stats = None, None, None
        self.chunk = None  # rows per chunk; None: from cfg.chunk_elems
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

    # -- masked baselines -----------------------------------------------------------------------
    def _run_chunks(self, q, k, v, chunk_fn):
        """chunk_fn(r0, q_rows, k, v) -> (out_rows, slot_sum, aux_sum) for rows r0 .. r0 + c."""
        B, n, H, _ = q.shape
        c = self.chunk or chunk_rows(self.cfg, B, H, n)
        outs, slots, aux = [], 0.0, 0.0
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        for r0 in range(0, n, c):
            q_rows = q[:, r0:r0 + c]
            if grad:
                o, s, a = checkpoint(chunk_fn, r0, q_rows, k, v, use_reentrant=False)
            else:
                o, s, a = chunk_fn(r0, q_rows, k, v)
            outs.append(o)
            slots = slots + s
            aux = aux + a
        return torch.cat(outs, 1).to(q.dtype), slots, aux

    def _swa(self, q, k, v, x, rope):
        n, H, W = q.shape[1], q.shape[2], self.cfg.ceiling
        scale = 1.0 / math.sqrt(q.shape[-1])

        def fn(r0, q_rows, k, v):
            allow = swa_allow(r0, r0 + q_rows.shape[1], n, W, q.device)
            o, _ = masked_chunk(q_rows, k, v, allow, scale)
            return o, allow.sum().float() * q.shape[0] * H, q.new_zeros(())

        out, s, _ = self._run_chunks(q, k, v, fn)
        self.last_slots = (s / (q.shape[0] * n * H)).detach()
        return out

    def _moba(self, q, k, v, x, rope):
        B, n, H, _ = q.shape
        blk, topk = self.cfg.moba_block, self.cfg.moba_topk
        scale = 1.0 / math.sqrt(q.shape[-1])
        kmean = block_means(k.detach(), blk)  # routing is not differentiated, as in MoBA

        def fn(r0, q_rows, k, v):
            allow = moba_allow(moba_gate(q_rows.detach(), kmean), r0, n, blk, topk)
            o, _ = masked_chunk(q_rows, k, v, allow, scale)
            return o, allow.sum().float(), q.new_zeros(())

        out, s, _ = self._run_chunks(q, k, v, fn)
        self.last_slots = (s / (B * n * H)).detach()
        return out

    def _dsa(self, q, k, v, x, rope):
        B, n, H, _ = q.shape
        cfg = self.cfg
        scale = 1.0 / math.sqrt(q.shape[-1])
        xd = x.detach()  # the indexer learns only from its KL loss
        qi = rope(self.iq(xd).view(B, n, cfg.dsa_heads, cfg.dsa_dim)) * cfg.dsa_dim ** -0.5
        ki = rope(self.ik(xd).view(B, n, 1, cfg.dsa_dim))[:, :, 0]
        wi = self.iw(xd) * cfg.dsa_heads ** -0.5

        def fn(r0, q_rows, k, v, qi=qi, ki=ki, wi=wi):
            c = q_rows.shape[1]
            scores = dsa_index_scores(qi[:, r0:r0 + c], ki, wi[:, r0:r0 + c])
            allow = dsa_allow(scores.detach(), r0, cfg.ceiling)
            o, p = masked_chunk(q_rows, k, v, allow[:, None], scale)
            target = p.detach().mean(1)  # [B, c, n], zero off the selection
            logq = torch.log_softmax(scores.masked_fill(~allow, float("-inf")), dim=-1)
            kl = (target * (torch.log(target.clamp_min(1e-30)) - logq.masked_fill(~allow, 0.0))).sum()
            return o, allow.sum().float() * H, kl

        out, s, kl = self._run_chunks(q, k, v, fn)
        self.last_slots = (s / (B * n * H)).detach()
        self.aux = cfg.dsa_kl_weight * kl / (B * n)
        return out

    # -- nsa through fla-core -------------------------------------------------------------------
    def _nsa(self, q, k, v, x, rope):
        parallel_nsa = _parallel_nsa()
        B, n, H, d = q.shape
        cfg = self.cfg
        dt = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
        # Each model head becomes one KV head with NSA_GROUP identical query heads: the kernel's
        # group-shared block selection is then exactly per head, and the model stays the same as
        # every other method's (the group's outputs are identical; the first one is kept).
        qg = q.to(dt).repeat_interleave(NSA_GROUP, dim=2)
        g = torch.sigmoid(self.gate(x)).to(dt).repeat_interleave(NSA_GROUP, dim=2)
        g_cmp, g_slc, g_swa = g[..., :H * NSA_GROUP], g[..., H * NSA_GROUP:2 * H * NSA_GROUP], g[..., 2 * H * NSA_GROUP:]
        out = parallel_nsa(qg, k.to(dt).contiguous(), v.to(dt).contiguous(), g_cmp.contiguous(), g_slc.contiguous(),
                           g_swa.contiguous(), block_counts=cfg.nsa_blocks, block_size=cfg.nsa_block,
                           window_size=cfg.nsa_window)
        self.last_slots = torch.tensor(nsa_nominal_slots(n, cfg))
        return out.view(B, n, H, NSA_GROUP, d)[:, :, :, 0].to(q.dtype)


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

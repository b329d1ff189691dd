"""The study's first swa / moba / dsa: explicit boolean masks over query chunks, float32, every
score materialized.  Too slow for an 8K sequence on the GPU; kept here as the reference that the
flex_attention path (lab/ar/ar_methods.py) must reproduce on small shapes."""

import math

import torch

import ar_methods as M


def swa_allow(r0, r1, n, window, device):
    """[c, n]: i - window < j <= i."""
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (j <= i) & (j > i - window)


def moba_allow(gate, r0, n, block, topk):
    """[B, H, c, n] from gate scores [B, H, c, nb]: the current block plus the top (topk - 1) past
    blocks by score, keys causal."""
    c, nb = gate.shape[2], gate.shape[3]
    dev = gate.device
    cur = (torch.arange(r0, r0 + c, device=dev) // block)[:, None]
    b = torch.arange(nb, device=dev)[None, :]
    s = gate.masked_fill(b > cur, float("-inf")).masked_fill(b == cur, float("inf"))
    idx = s.topk(min(topk, nb), dim=-1).indices
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & (b <= cur)
    keys_block = torch.arange(n, device=dev) // block
    return chosen[..., keys_block] & M.causal_allow(r0, r0 + c, n, dev)


def dsa_allow(scores, r0, topk):
    """[B, c, n]: the top-k past keys of each row by indexer score (all of them when fewer)."""
    c, n = scores.shape[1], scores.shape[2]
    causal = M.causal_allow(r0, r0 + c, n, scores.device)
    s = scores.masked_fill(~causal, float("-inf"))
    idx = s.topk(min(topk, n), dim=-1).indices
    return torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & causal


def masked_chunk(q_rows, k, v, allow, scale):
    s = torch.einsum("bchd,bnhd->bhcn", q_rows.float(), k.float()) * scale
    p = torch.softmax(s.masked_fill(~allow, float("-inf")), dim=-1)
    return torch.einsum("bhcn,bnhd->bchd", p, v.float()), p


def forward(m, q, k, v, x, rope):
    """(out, last_slots, aux) of the old implementation of module m's method (one chunk: the old
    tests showed chunking changes nothing), with m's own indexer weights for dsa."""
    B, n, H, d = q.shape
    cfg, scale = m.cfg, 1.0 / math.sqrt(d)
    if m.method == "swa":
        allow = swa_allow(0, n, n, cfg.ceiling, q.device)
        out, _ = masked_chunk(q, k, v, allow, scale)
        return out.to(q.dtype), allow.sum().float() * B * H / (B * n * H), None
    if m.method == "moba":
        gate = M.moba_gate(q.detach(), M.block_means(k.detach(), cfg.moba_block))
        allow = moba_allow(gate, 0, n, cfg.moba_block, cfg.moba_topk)
        out, _ = masked_chunk(q, k, v, allow, scale)
        return out.to(q.dtype), allow.sum().float() / (B * n * H), None
    assert m.method == "dsa"
    xd = x.detach()
    qi = rope(m.iq(xd).view(B, n, cfg.dsa_heads, cfg.dsa_dim)) * cfg.dsa_dim ** -0.5
    ki = rope(m.ik(xd).view(B, n, 1, cfg.dsa_dim))[:, :, 0]
    wi = m.iw(xd) * cfg.dsa_heads ** -0.5
    scores = M.dsa_index_scores(qi, ki, wi)
    allow = dsa_allow(scores.detach(), 0, cfg.ceiling)
    out, p = masked_chunk(q, k, v, allow[:, None], scale)
    target = p.detach().mean(1)
    logq = torch.log_softmax(scores.masked_fill(~allow, float("-inf")), dim=-1)
    kl = (target * (torch.log(target.clamp_min(1e-30)) - logq.masked_fill(~allow, 0.0))).sum()
    return out.to(q.dtype), allow.sum().float() * H / (B * n * H), cfg.dsa_kl_weight * kl / (B * n)


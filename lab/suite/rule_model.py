"""A plain PyTorch model of MALA's forward tile rule (docs/spec.md, "Forward: the online test").

Used by the suite for two things only: to place inputs on the retained-fraction axis when the mala
package cannot report its own statistics (for example to plot flash-sparse-attn against the same
inputs), and to calibrate the synthetic sharpness sweep.  It is not the library's reference and not
a timing subject.  Causal, Nq == Nk, batch and heads flattened; fp32 arithmetic on the given
(bf16-rounded) inputs; tiles Bq x Bk.

For each query tile, key tiles are visited from the diagonal down to tile 0; a tile is skipped iff
every valid row r with a legal key in it has rowmax - m - log(l) < log(tau) - log(L_r), with l = 0
meaning "retain".  All query tiles advance together: step t visits key tile i - t of query tile i.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def forward_rule(q: torch.Tensor, k: torch.Tensor, tau: float, block_q: int = 128,
                 block_k: int = 128, scale: float | None = None):
    """q [B, N, Hq, d], k [B, N, Hkv, d] -> dict(retained_fraction, mean_slots, lse [B, Hq, N]).

    block_q must equal block_k (the diagonal walk assumes square tiles)."""
    assert block_q == block_k, "square tiles only"
    B, N, Hq, d = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    T = block_q
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    nT = (N + T - 1) // T
    pad = nT * T - N
    qf = q.float().permute(0, 2, 1, 3)                     # [B, Hq, N, d]
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    if pad:
        qf = torch.nn.functional.pad(qf, (0, 0, 0, pad))
        kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
    BH = B * Hq
    qt = qf.reshape(BH, nT, T, d)
    kt = kf.reshape(BH, nT, T, d)
    dev = q.device
    rows = torch.arange(nT * T, device=dev).view(nT, T)   # query positions
    valid = rows < N
    L = (rows + 1).clamp(max=N).float()
    log_thr = (math.log(tau) if tau > 0 else -math.inf) - torch.log(L)   # [nT, T]
    m = torch.full((BH, nT, T), -math.inf, device=dev)
    lsum = torch.zeros((BH, nT, T), device=dev)
    retained_tiles = torch.zeros((BH,), dtype=torch.float64, device=dev)
    slots = torch.zeros((BH, nT, T), dtype=torch.float64, device=dev)
    legal_tiles = BH * nT * (nT + 1) / 2
    for t in range(nT):
        i = torch.arange(t, nT, device=dev)
        j = i - t
        s = torch.einsum("bimd,bind->bimn", qt[:, i], kt[:, j]) * scale   # [BH, ni, T, T]
        keys = j[:, None] * T + torch.arange(T, device=dev)[None, :]         # [ni, T]
        legal = (keys[:, None, :] <= rows[i][:, :, None]) & (keys[:, None, :] < N)
        s = s.masked_fill(~legal[None], -math.inf)
        rmax = s.amax(dim=-1)                                             # [BH, ni, T]
        mi, li = m[:, i], lsum[:, i]
        has = legal.any(dim=-1) & valid[i]                                # rows with a legal key
        lhs = torch.where(li > 0, rmax - mi - torch.log(li), torch.full_like(rmax, math.inf))
        fails = (lhs >= log_thr[i][None]) & has[None]
        keep = fails.any(dim=-1)                                          # [BH, ni]
        if tau == 0:
            keep = torch.ones_like(keep)
        m_new = torch.maximum(mi, rmax)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe[..., None]).sum(-1)
        l_new = li * torch.exp(mi - m_safe) + p
        kk = keep[..., None]
        m[:, i] = torch.where(kk, m_new, mi)
        lsum[:, i] = torch.where(kk, l_new, li)
        retained_tiles += keep.sum(dim=1).double()
        slots[:, i] += (kk & has[None]).double() * T
    lse = (m + torch.log(lsum)).reshape(BH, nT * T)[:, :N].reshape(B, Hq, N)
    return {
        "retained_fraction": float(retained_tiles.sum().item() / legal_tiles),
        "mean_slots": float(slots.reshape(BH, nT * T)[:, :N].mean().item()),
        "lse": lse,
    }


@torch.no_grad()
def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, chunk: int = 2048):
    """Exact causal lse [B, Hq, N] in fp32 from q [B, N, Hq, d], k [B, N, Hkv, d] (row chunks)."""
    B, N, Hq, d = q.shape
    g = Hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float().permute(0, 2, 1, 3)
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    out = torch.empty(B, Hq, N, device=q.device)
    for r0 in range(0, N, chunk):
        r1 = min(N, r0 + chunk)
        s = torch.einsum("bhmd,bhnd->bhmn", qf[:, :, r0:r1], kf[:, :, :r1]) * scale
        pos = torch.arange(r0, r1, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(r1, device=q.device)[None, :] > pos, -math.inf)
        out[:, :, r0:r1] = torch.logsumexp(s, dim=-1)
    return out

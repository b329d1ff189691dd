"""Operator fidelity on identical attention states (docs/real.md's Fig. 2 protocol): MALA at tau
against tau = 0 on the same Q, K, V with the same dO probe, per head.  Used by qwen_measure.py (the
real model) and lab/train/analyze.py (the models trained from scratch)."""

import torch


def rel_err_heads(x, ref):
    """Relative L2 error per head of [1, N, H, d] tensors -> [H]."""
    dx = (x.float() - ref.float()).square().sum(dim=(0, 1, 3))
    return (dx.sqrt() / ref.float().square().sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-30)).tolist()


def retained_per_head(mask):
    m = mask[0]
    ret = (m == 2).sum(dim=(1, 2)).double()
    legal = (m >= 1).sum(dim=(1, 2)).double()
    return (ret / legal).tolist()


def run_tau(mala, q, k, v, dout, tau):
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse, st = mala.attention(qg, kg, vg, tau=tau, causal=True, return_lse=True, return_stats=True)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    return out.detach(), lse.detach(), st, dq, dk, dv


def layer_metrics(mala, q, k, v, dout, taus):
    """{tau: per-head metrics} for one layer's states (q [1, N, Hq, d] ...) against tau = 0."""
    o0, lse0, _, dq0, dk0, dv0 = run_tau(mala, q, k, v, dout, 0.0)
    out = {}
    for tau in taus:
        o1, lse1, st, dq1, dk1, dv1 = run_tau(mala, q, k, v, dout, tau)
        om = (1.0 - torch.exp(lse1[0].double() - lse0[0].double())).clamp_min(0.0)  # [Hq, N]
        out[tau] = {
            "fwd_slots": st.fwd_slots[0].double().mean(dim=1).tolist(),
            "bwd_slots": st.bwd_slots[0].double().mean(dim=1).tolist(),
            "fwd_retained": retained_per_head(st.fwd_tile_mask),
            "bwd_retained": retained_per_head(st.bwd_tile_mask),
            "omitted_mean": om.mean(dim=1).tolist(),
            "omitted_p95": torch.quantile(om.float(), 0.95, dim=1).tolist(),
            "omitted_max": om.max(dim=1).values.tolist(),
            "o_err": rel_err_heads(o1, o0),
            "dq_err": rel_err_heads(dq1, dq0),
            "dk_err": rel_err_heads(dk1, dk0),
            "dv_err": rel_err_heads(dv1, dv0),
        }
        tiles = {"fwd": [st.fwd_block_q, st.fwd_block_k], "bwd": [st.bwd_block_q, st.bwd_block_k]}
        del o1, lse1, st, dq1, dk1, dv1
    return out, tiles

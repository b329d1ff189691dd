"""The gradient's fidelity for each attention, on a model's current weights: analyze.py grads runs it
on a trained model, train.py --grad-probe-every at intervals during training.

For each batch: the whole model's parameter gradient under the training's bf16 autocast with each
attention (SDPA, SDPA's memory-efficient kernel, MALA at tau = 0 and at tau) against two references:
the same model in fp32 without autocast on SDPA's math kernel (grad_*: the step's error, bf16
autocast's everywhere) and the same bf16 model with its attention alone in fp32 ("sdpa_fp32";
attn_*: the attention's own error).  Each comparison gives the relative L2 error, the cosine and the
error's component along the reference (bias: negative where the attention shrinks the step, the kind
of error a relative norm hides); rel_to_sdpa is how far the memory-efficient kernel's and MALA tau =
0's gradients are from cuDNN's.  The model's attention and MALA's registered tau are restored after.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import torch

import attn
import train
from train_summary import t_interval


def labels(tau):
    """(label, registered attention, MALA tau or None) for each attention compared."""
    return (("sdpa", "sdpa", None), ("sdpa_ea", "sdpa_ea", None), ("mala_tau0", "mala", 0.0),
            (f"mala_tau{tau:g}", "mala", tau))


def _vs(g, ref):
    d = g - ref
    rr = float(ref.dot(ref))
    return {"rel_err": float(d.norm()) / math.sqrt(rr),
            "cosine": float(torch.nn.functional.cosine_similarity(g, ref, dim=0)), "bias": float(d.dot(ref)) / rr}


def batches(seqs, n_batches, per_batch, device, args=("--batches", "--sequences")):
    """The first n_batches x per_batch of the sequences seqs ([S, N] array), as n_batches disjoint [per_batch,
    N] int64 tensors on device; where seqs has fewer, a ValueError naming the two arguments (args)."""
    if len(seqs) < n_batches * per_batch:
        raise ValueError(f"{args[0]} {n_batches} x {args[1]} {per_batch}: the held-out split has {len(seqs)} "
                         f"sequences of that length")
    return [torch.from_numpy(np.ascontiguousarray(seqs[b * per_batch:(b + 1) * per_batch]).astype(np.int64)).to(device)
            for b in range(n_batches)]


def probe(model, xs, device, tau, restore, log=None):
    """The fidelity over the batches xs ([B, N] int64 tensors on device); restore = (attention name,
    MALA tau) the model trains with, put back before returning."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def grad(x, name, amp, backend=None):
        attn.set_attention(model, name)
        model.zero_grad(set_to_none=True)
        with (train.autocast(device) if amp else nullcontext()), (sdpa_kernel([backend]) if backend else nullcontext()):
            loss = train.sequence_loss(model, x)
        loss.backward()
        g = torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), g

    out = {"batches": len(xs), "attention": {lab: {"per_batch": []} for lab, _, _ in labels(tau)}}
    try:
        for b, x in enumerate(xs):
            loss_ref, ref = grad(x, "sdpa", amp=False, backend=SDPBackend.MATH)
            _, ref_attn = grad(x, "sdpa_fp32", amp=True)
            got = {}
            for label, name, t in labels(tau):
                if t is not None:
                    attn.register(t)
                loss, g = grad(x, name, amp=True)
                got[label] = g
                full, own = _vs(g, ref), _vs(g, ref_attn)
                out["attention"][label]["per_batch"].append(
                    {"loss": loss, "loss_reference": loss_ref, "grad_rel_err": full["rel_err"],
                     "grad_cosine": full["cosine"], "grad_bias": full["bias"], "attn_rel_err": own["rel_err"],
                     "attn_bias": own["bias"]})
                if log:
                    log(f"batch {b} {label}: loss {loss:.5f} (fp32 {loss_ref:.5f}), gradient rel. error "
                        f"{full['rel_err']:.3e}, cosine {full['cosine']:.6f}; against fp32 attention "
                        f"{own['rel_err']:.3e}, bias {own['bias']:+.2e}")
            for label in ("sdpa_ea", "mala_tau0"):
                out["attention"][label]["per_batch"][-1]["rel_to_sdpa"] = _vs(got[label], got["sdpa"])["rel_err"]
    finally:
        attn.register(restore[1])
        attn.set_attention(model, restore[0])
        model.zero_grad(set_to_none=True)
    for label in out["attention"]:
        rows = out["attention"][label]["per_batch"]
        for k in rows[0]:
            out["attention"][label][k] = float(np.mean([r[k] for r in rows]))
        if len(rows) > 1:
            out["attention"][label]["attn_bias_ci95"] = t_interval([r["attn_bias"] for r in rows])
    out["loss_reference"] = float(np.mean([r["loss_reference"] for r in out["attention"]["sdpa"]["per_batch"]]))
    return out

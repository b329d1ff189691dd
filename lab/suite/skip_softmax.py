#!/usr/bin/env python3
"""Issue #66 part 2: MALA against NVIDIA's skip-softmax (FlashInfer fmha_v2) at matched sparsity.

    python3 lab/suite/skip_softmax.py --dry-run                   # print the plan, touch no GPU
    python3 lab/suite/skip_softmax.py --out OUT [--ns 8,32,128]   # on the GPU (after the guard)

Forward only, Hq 8 / Hkv 1, d 128, bf16, causal, batch 1; inputs random and synthetic (the `s`
sweep of lab/suite/workloads.py).  Per (N, input): MALA at each tau (its realized retained fraction
from return_stats), FlashInfer skip-softmax at the scale factor whose replayed retained fraction
(fi_system.blasst_critical: the kernel reports none) matches each MALA tau's, FlashInfer dense
(scale factor 0), FlashAttention-4, cuDNN (SDPA) and MALA tau = 0.  Omitted mass from each
system's lse against the dense lse; o_err the relative L2 of O against SDPA's flash kernel.
Writes OUT/skip_softmax.json in the issue's format, {"device", "synthetic": [{"N", "input",
"system", "knob", "ms", "retained", "omitted_mean", "omitted_p95", "o_err"}, ...]}, saved after
every input so that a deadline keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

KI = 1024
FAMILY = {"mala": "mala", "flashinfer_sf": "flashinfer_skip_softmax", "flashinfer": "flashinfer",
          "fa4": "fa4", "sdpa_cudnn": "cudnn"}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fl = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128],
                    help="sequence lengths in K tokens")
    ap.add_argument("--sharpness", type=fl, default=[0.0, 2.0, 3.0, 4.0, 6.0, 10.0],
                    help="0 = random inputs, else synthetic at that sharpness")
    ap.add_argument("--taus", type=fl, default=[1.0, 4.0, 16.0, 64.0])
    ap.add_argument("--fi-scale-factors", type=fl, default=None,
                    help="fixed FlashInfer scale factors instead of matching MALA's retained fraction")
    ap.add_argument("--out", default=os.environ.get("OUT") or "skip_softmax_out")
    ap.add_argument("--min-reps", type=int, default=20)
    ap.add_argument("--target-s", type=float, default=0.4)
    ap.add_argument("--deadline", type=float, default=None, help="unix time to stop starting inputs")
    ap.add_argument("--dry-run", action="store_true")
    return ap.parse_args(argv)


def input_name(sharp):
    return "random" if not sharp else f"synthetic(s={sharp:g})"


def plan(args):
    names = [f"mala_tau{t:g}" for t in args.taus] + ["mala_tau0"]
    fi = ([f"flashinfer_sf{f:g}" for f in args.fi_scale_factors] if args.fi_scale_factors
          else [f"flashinfer_sf<matched to mala_tau{t:g}>" for t in args.taus])
    names += fi + ["flashinfer", "fa4", "sdpa_cudnn"]
    return [{"N": n * KI, "input": input_name(s), "sharpness": s, "systems": names}
            for n in args.ns for s in args.sharpness]


def family(name):
    for prefix, fam in FAMILY.items():
        if name.startswith(prefix):
            return fam
    return name


def to_issue_row(rec):
    sharp = rec.get("sharpness") or 0.0
    return {"N": rec["N"], "input": input_name(sharp) if rec.get("regime") != "random" else "random",
            "system": family(rec["system"]), "knob": rec.get("tau"), "ms": rec.get("ms"),
            "retained": rec.get("fwd_retained_fraction"), "omitted_mean": rec.get("omitted_mass_mean"),
            "omitted_p95": rec.get("omitted_mass_p95"), "o_err": rec.get("rel_l2_o")}


def _omitted(lse, lse_dense):
    import torch
    om = (1.0 - torch.exp(lse.float() - lse_dense.float())).flatten()
    om = om[torch.isfinite(om)]
    if om.numel() == 0:
        return None, None
    om = om.clamp_min(0.0)
    p95 = torch.quantile(om[torch.randperm(om.numel(), device=om.device)[:1 << 24]], 0.95)
    return float(om.mean()), float(p95)


def run_input(args, N, sharp, S, common, timing, fi):
    import torch
    regime = "synthetic" if sharp else "random"
    q, k, v, _ = common.make_inputs(regime, 1, N, 8, 1, 128, sharp, seed=0, with_dout=False)
    g = 8
    qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
    with torch.no_grad():
        res = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, True, False)
    o_ref, lse_dense = res[0].transpose(1, 2), res[1].float()[..., :N]
    del qb, kb, vb, res
    systems = [S.Mala(t) for t in args.taus] + [S.Mala(0.0)]
    mala_ret = {}
    recs = []
    for s in systems:
        rec = {"system": s.name, "tau": s.tau, "regime": regime, "sharpness": sharp, "N": N}
        why = s.available()
        if why:
            rec.update(status="unavailable", reason=why)
        else:
            out, lse, st = S._MALA["mod"].attention(q, k, v, tau=s.tau, causal=True, return_lse=True,
                                                    return_stats=True)
            rec["fwd_retained_fraction"] = st.fwd_retained_fraction
            mala_ret[s.tau] = st.fwd_retained_fraction
            _measure(args, rec, s, q, k, v, out, lse, o_ref, lse_dense, common, timing)
        recs.append(rec)
    crit = fi.blasst_critical(q, k)
    if args.fi_scale_factors:
        sfs = [(f, None) for f in args.fi_scale_factors]
    else:
        sfs = [(fi.matched_scale_factor(crit, mala_ret[t]), t) for t in args.taus if t in mala_ret]
    others = [(S.flashinfer_system(f), t) for f, t in sfs if f > 0]
    others += [(S.flashinfer_system(0.0), None), (S.FA4(), None), (S.SDPA("cudnn"), None)]
    for s, t in others:
        rec = {"system": s.name, "tau": getattr(s, "scale_factor", None), "regime": regime,
               "sharpness": sharp, "N": N}
        if t is not None:
            rec["matched_to_mala_tau"] = t
        if hasattr(s, "scale_factor"):
            rec["fwd_retained_fraction"] = fi.retained_at(crit, s.scale_factor)
            rec["retained_source"] = "rule replay (fi_system.blasst_critical)"
        why = s.available()
        if why:
            rec.update(status="unavailable", reason=why)
        else:
            try:
                out, lse = s.outputs(q, k, v)
                _measure(args, rec, s, q, k, v, out, lse, o_ref, lse_dense, common, timing)
            except Exception as e:  # noqa: BLE001
                rec.update(status="failed", reason=f"{type(e).__name__}: {e}"[:400])
        recs.append(rec)
    return recs


def _measure(args, rec, s, q, k, v, out, lse, o_ref, lse_dense, common, timing):
    rec["rel_l2_o"] = common.rel_l2(out, o_ref)
    if lse is not None:
        rec["omitted_mass_mean"], rec["omitted_mass_p95"] = _omitted(lse, lse_dense)
    p = s.prepare(q, k, v, None, need_grad=False)
    m = timing.measure(p.fwd, min_reps=args.min_reps, target_s=args.target_s)
    rec.update(status="ok", **m)


def main(argv=None):
    args = parse(argv)
    pl = plan(args)
    if args.dry_run:
        for p in pl:
            print(f"N={p['N']:6d} {p['input']:18s} {', '.join(p['systems'])}")
        print(f"{len(pl)} inputs; writes {os.path.join(args.out, 'skip_softmax.json')}")
        return 0
    import torch
    import common
    import fi_system as fi
    import systems as S
    import timing
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "skip_softmax.json")
    doc = {"device": torch.cuda.get_device_name(), "synthetic": [], "records": [],
           "env": common.env_info(S), "notes": [
               "retained: MALA's return_stats; FlashInfer's from its rule replayed in torch",
               "o_err: relative L2 of O against SDPA flash (dense, bf16)",
               "omitted: 1 - exp(lse - lse_dense) per row; mean and 95th percentile"]}
    for p in pl:
        if args.deadline and time.time() > args.deadline:
            doc["notes"].append(f"deadline: stopped before N={p['N']} {p['input']}")
            break
        t0 = time.time()
        try:
            recs = run_input(args, p["N"], p["sharpness"], S, common, timing, fi)
        except Exception as e:  # noqa: BLE001
            recs = [{"system": "?", "N": p["N"], "status": "failed", "reason": f"{type(e).__name__}: {e}"[:400]}]
        for r in recs:
            doc["records"].append(r)
            if r.get("status") == "ok":
                doc["synthetic"].append(to_issue_row(r))
            print(json.dumps({kk: r.get(kk) for kk in ("N", "system", "tau", "status", "ms",
                              "fwd_retained_fraction", "omitted_mass_mean", "rel_l2_o", "reason")}), flush=True)
        print(f"[{time.time() - t0:.1f}s] N={p['N']} {p['input']} done", flush=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

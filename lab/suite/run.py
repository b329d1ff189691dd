#!/usr/bin/env python3
"""MALA benchmark suite (issue 7): MALA against the dense and sparse anchors of docs/benchmarks.md.

    python3 lab/suite/run.py [--quick] [--out DIR] [--sections guard,primary,decode,sweep,secondary]
    python3 lab/suite/run.py --sections real --real DIR/layer05,DIR/layer27 [--real-ns 8192,32768]
    python3 lab/suite/run.py --dist 4 [--quick] [--out DIR]      # tensor parallel over heads (issue 6)

Usually started through lab/scripts/bench_suite.sh (installs carried wheels, builds mala, sets the
NCCL environment).  Writes OUT/results.json (every measurement, the environment, the checks),
OUT/*.png and OUT/summary.md; prints one line per measurement.  docs/benchmarks.md says more.

Sections (each self-contained: every ratio it implies is measured inside it, on one device):
  guard      correctness of every system on small shapes against an fp32 reference (flags systems)
  primary    Hq=8 Hkv=1 d=128 bf16 causal batch 1, random inputs, N = 1K..128K: fwd, bwd, fwd+bwd
  decode     1 query token against a KV cache of N, batch 1 and 8, random and synthetic inputs
  sweep      synthetic inputs swept over sharpness: speedup over the fastest dense baseline
             against the retained fraction (fwd, bwd)
  secondary  head dim 64 and MHA (Hq = Hkv = 8), random inputs
  fa4        (not in the default list) the shapes of issue 67's table against FlashAttention-4:
             FA4_SHAPES at N = 8K, 32K, 128K, fwd and bwd, random inputs; kernels_vs_fa4.py turns
             its records into bench/results/kernels_vs_fa4.json
  calibrate  (not in the default list) rule-model retained fraction vs sharpness at --sweep-ns
A time budget (--deadline, or --budget-s) skips what would not fit and says so in the results.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # never NVLink multicast (device notes), also in every child process

import torch  # noqa: E402

import common  # noqa: E402
import rule_model  # noqa: E402
import systems as S  # noqa: E402
import timing  # noqa: E402

KI = 1024

FULL = {
    # the anchors' lengths first (8K, 32K, 128K, 64K), so that a run cut short by its deadline
    # still has them; tables and plots sort by N
    "primary_ns": [8, 32, 128, 64, 1, 2, 4, 16],
    "decode_ns": [1, 2, 4, 8, 16, 32, 64, 128],
    "decode_batches": [1, 8],
    "decode_sharpness": 10.0,
    "sweep_ns": [32, 128],
    "sweep_ops": ["fwd", "bwd"],
    "secondary_ns": [2, 8, 32],
    "fa4_ns": [8, 32, 128],
    "ops": ["fwd", "bwd", "fwd_bwd"],
    "target_s": 0.6,
}
QUICK = {
    "primary_ns": [2, 8],
    "decode_ns": [8, 32],
    "decode_batches": [1, 8],
    "decode_sharpness": 10.0,
    "sweep_ns": [8],
    "sweep_ops": ["fwd", "bwd"],
    "secondary_ns": [4],
    "fa4_ns": [8],
    "ops": ["fwd", "bwd", "fwd_bwd"],
    "target_s": 0.3,
}
# Sharpness values of the synthetic sweep, per sequence length (K tokens).  Chosen so that MALA's
# retained fraction at tau = 1 spans ~100% down to its floor (diagonal, sink and needle tiles:
# a few tiles per query tile, under 2% from 32K on); --calibrate re-derives them with the rule model.
# docs/workloads.md measured (CPU, Hq = Hkv = 1, tau = 1): 8K: s=2 88.9%, 3 41.0%, 4 20.2%,
# 6 11.2%, 10 9.7% (floor); 32K: s=2 87.9%, 3 27.3%, 4 9.6%, 6 3.9%, 10 2.6%; 64K: s=10 1.32%.
SWEEP_SHARPNESS = {
    "default": [0.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0],
    128: [0.0, 2.0, 3.0, 4.0, 6.0, 10.0],
}
DEFAULT_SYSTEMS = ["sdpa_flash", "sdpa_cudnn", "flex", "fsa", "mala", "mala0"]
# The fa4 section's (Hq, Hkv, d): the two d = 128 head layouts of issue 67's targets, then d = 64
# and d = 256 (no slower than before).
FA4_SHAPES = ((8, 1, 128), (12, 2, 128), (8, 1, 64), (8, 1, 256))
DENSE = ("sdpa_flash", "sdpa_cudnn", "flex")
RESERVE_S = 30.0  # kept for writing plots and the summary


class Ctx:
    def __init__(self, args, cfg, res):
        self.args, self.cfg, self.res = args, cfg, res
        self.t0 = time.time()
        self.deadline = args.deadline if args.deadline else self.t0 + args.budget_s
        self.last_cost = {}   # (section, system, op, shape) -> (N, seconds)
        self.dead = None      # set when the CUDA context is lost
        self.unavailable = {}

    def elapsed(self):
        return time.time() - self.t0

    def left(self):
        return self.deadline - RESERVE_S - time.time()

    def log(self, msg):
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)


def base_rec(section, op, sysm, regime, sharp, B, N, Hq, Hkv, d, **kw):
    rec = {"section": section, "op": op, "system": sysm.name, "label": sysm.label, "tau": sysm.tau,
           "regime": regime, "sharpness": sharp, "B": B, "N": N, "Hq": Hq, "Hkv": Hkv, "d": d}
    rec.update(kw)
    return rec


def _cuda_alive():
    if timing.DEVICE == "cpu":
        return True
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _classify(e):
    msg = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower():
        return "oom", msg[:400]
    if isinstance(e, S.Unsupported):
        return "unsupported", msg[:400]
    return "failed", msg[:600]


def predict_cost(ctx, key, N):
    prev = ctx.last_cost.get(key)
    if prev is None:
        return 0.0
    n0, s0 = prev
    return max(s0 * (N / n0) ** 2, min(s0, 2.0))  # quadratic in N, at least ~2 s of fixed cost


def run_measure(ctx, rec, key, fn, flops=None, bytes_moved=None, setup=None):
    """Measure fn into rec (status, ms, TF/s, memory); returns rec.  Never raises."""
    N = rec["N"]
    if ctx.dead:
        rec.update(status="skipped", reason=f"CUDA context lost earlier ({ctx.dead})")
        return rec
    need = predict_cost(ctx, key, N)
    if need > ctx.left():
        rec.update(status="skipped", reason=f"time budget (needs ~{need:.0f}s, {max(ctx.left(), 0):.0f}s left)")
        return rec
    t = time.time()
    try:
        m = timing.measure(fn, min_reps=ctx.args.min_reps, target_s=ctx.cfg["target_s"], setup=setup)
        rec.update(status="ok", **m)
        if flops:
            rec["dense_flops"] = flops
            rec["tflops_dense_equiv"] = flops / (m["ms"] * 1e-3) / 1e12
        if bytes_moved:
            rec["kv_bytes"] = bytes_moved
            rec["kv_gbps"] = bytes_moved / (m["ms"] * 1e-3) / 1e9
    except Exception as e:  # noqa: BLE001
        st, why = _classify(e)
        rec.update(status=st, reason=why)
        if ctx.args.verbose:
            traceback.print_exc()
        if not _cuda_alive():
            ctx.dead = f"{rec['system']} {rec['op']} N={N}: {why[:160]}"
    ctx.last_cost[key] = (N, time.time() - t)
    gc.collect()
    timing.empty_cache() if not ctx.dead else None
    return rec


def describe(rec):
    s = f"{rec['section']:9s} {rec['op']:8s} {rec['regime']}"
    if rec.get("sharpness"):
        s += f"(s={rec['sharpness']:g})"
    s += f" B={rec['B']} N={rec['N']} Hq={rec['Hq']} Hkv={rec['Hkv']} d={rec['d']} {rec['system']:12s}"
    if rec["status"] != "ok":
        return s + f" {rec['status'].upper()}: {rec.get('reason', '')[:200]}"
    s += f" {rec['ms']:9.3f} ms"
    if rec.get("tflops_dense_equiv") is not None and rec["op"] != "decode":
        s += f" ({rec['tflops_dense_equiv']:6.1f} TF/s dense-equiv)"
    if rec.get("kv_gbps") is not None:
        s += f" ({rec['kv_gbps']:7.1f} GB/s of K+V)"
    s += f" peak {common.fmt_bytes(rec['peak_bytes'])}"
    if rec.get("fwd_slots_mean") is not None:
        s += f" | slots/query fwd {rec['fwd_slots_mean']:.0f}"
        if rec.get("bwd_slots_mean") is not None:
            s += f" bwd {rec['bwd_slots_mean']:.0f}"
        s += f", retained fwd {100 * rec['fwd_retained_fraction']:.2f}%"
        if rec.get("bwd_retained_fraction") is not None:
            s += f" bwd {100 * rec['bwd_retained_fraction']:.2f}%"
    if rec.get("omitted_mass_max") is not None:
        s += f", omitted mass mean {rec['omitted_mass_mean']:.2e} max {rec['omitted_mass_max']:.2e}"
    if rec.get("rule_retained_fraction") is not None:
        s += f", rule-model retained {100 * rec['rule_retained_fraction']:.2f}%"
    if rec.get("flagged"):
        s += f" [FLAGGED: {rec.get('flag_reason', '')[:80]}]"
    return s


def system_ok(ctx, sysm):
    if sysm.name not in ctx.unavailable:
        ctx.unavailable[sysm.name] = sysm.available()
    return ctx.unavailable[sysm.name]


# ---- sections -----------------------------------------------------------------------------------

def sparse_info(ctx, sysm, q, k, v, dout, lse_dense, with_bwd=True):
    """Realized work and omitted mass of a tau system on these inputs (not timed)."""
    info = {}
    try:
        if isinstance(sysm, S.Mala):
            st, lse = sysm.stats(q, k, v, dout if dout is not None else torch.randn_like(q))
            info.update(st)
            if not with_bwd:
                info.pop("bwd_slots_mean", None)
        else:
            _, lse = sysm.outputs(q, k, v)
            if hasattr(sysm, "rule_stats"):  # FlashInfer skip-softmax: its rule replayed in torch
                info.update(sysm.rule_stats(q, k))
        if lse is not None and lse_dense is not None:
            mean, mx = common.omitted_mass(lse, lse_dense)
            info.update(omitted_mass_mean=mean, omitted_mass_max=mx)
            if sysm.tau and mx is not None and mx > sysm.tau / (1 + sysm.tau) + 1e-4:
                info.update(flagged=True, flag_reason=f"omitted mass {mx:.3g} > tau/(1+tau)")
    except Exception as e:  # noqa: BLE001
        info["stats_error"] = _classify(e)[1]
    return info


def bench_training_shape(ctx, section, systems, regime, sharp, B, N, Hq, Hkv, d, ops, extra=None,
                         seed=0):
    """All ops of all systems on one input; returns the records."""
    recs = []
    if ctx.dead:
        for sysm in systems:
            for op in ops:
                r = base_rec(section, op, sysm, regime, sharp, B, N, Hq, Hkv, d, status="skipped",
                             reason=f"CUDA context lost earlier ({ctx.dead})", **(extra or {}))
                ctx.res.add(r)
                recs.append(r)
        return recs
    try:
        q, k, v, dout = common.make_inputs(regime, B, N, Hq, Hkv, d, sharp, seed)
    except Exception as e:  # noqa: BLE001
        for sysm in systems:
            for op in ops:
                r = base_rec(section, op, sysm, regime, sharp, B, N, Hq, Hkv, d, status="failed",
                             reason="input generation: " + _classify(e)[1], **(extra or {}))
                ctx.res.add(r)
                recs.append(r)
        return recs
    flops_fwd = timing.causal_flops_fwd(B, N, N, Hq, d)
    flops = {"fwd": flops_fwd, "bwd": 2.5 * flops_fwd, "fwd_bwd": 3.5 * flops_fwd}
    lse_dense = None
    if any(s.sparse for s in systems):
        try:
            lse_dense = common.dense_lse(q, k, v)
        except Exception as e:  # noqa: BLE001
            ctx.log(f"dense lse failed: {e}")
    rule = None
    if extra and extra.get("rule_model"):
        try:
            rule = rule_model.forward_rule(q, k, 1.0 if ctx.args.tau is None else ctx.args.tau)["retained_fraction"]
        except Exception as e:  # noqa: BLE001
            ctx.log(f"rule model failed: {e}")
    ex = {kk: vv for kk, vv in (extra or {}).items() if kk != "rule_model"}
    for sysm in systems:
        why = system_ok(ctx, sysm)
        if why:
            for op in ops:
                r = base_rec(section, op, sysm, regime, sharp, B, N, Hq, Hkv, d, status="unavailable",
                             reason=why, **ex)
                ctx.res.add(r)
                recs.append(r)
                ctx.log(describe(r))
            continue
        info = {}
        if sysm.sparse and sysm.tau and not ctx.dead:
            info = sparse_info(ctx, sysm, q, k, v, dout, lse_dense)
        if rule is not None:
            info["rule_retained_fraction"] = rule
        prep = None
        try:
            prep = sysm.prepare(q, k, v, dout, need_grad=any(o != "fwd" for o in ops))
        except Exception as e:  # noqa: BLE001
            st, why = _classify(e)
            for op in ops:
                r = base_rec(section, op, sysm, regime, sharp, B, N, Hq, Hkv, d, status=st,
                             reason="prepare: " + why, **ex, **info)
                ctx.res.add(r)
                recs.append(r)
                ctx.log(describe(r))
            continue
        for op in ops:
            r = base_rec(section, op, sysm, regime, sharp, B, N, Hq, Hkv, d, **ex, **info)
            key = (section, sysm.name, op, Hq, Hkv, d, regime)
            if op == "fwd":
                run_measure(ctx, r, key, prep.fwd, flops["fwd"])
            elif op == "bwd":
                graph_ok = True
                try:
                    if not ctx.dead and predict_cost(ctx, key, N) <= ctx.left():
                        prep.make_graph()
                except Exception as e:  # noqa: BLE001
                    st, why = _classify(e)
                    r.update(status=st, reason="forward for backward: " + why)
                    graph_ok = False
                if graph_ok:
                    run_measure(ctx, r, key, prep.bwd, flops["bwd"])
                    if r["status"] == "failed" and not ctx.dead:
                        # backward on a retained graph failed: rebuild the graph before every call
                        # instead (untimed) and call backward without retain_graph
                        first = r.pop("reason", "")
                        r2 = dict(r)
                        run_measure(ctx, r2, key, prep.bwd_once, flops["bwd"], setup=prep.make_graph)
                        r2["bwd_mode"] = "graph rebuilt before each call (retain_graph failed: " + first[:200] + ")"
                        r = r2
                prep.out_graph = None
            else:
                run_measure(ctx, r, key, prep.fwd_bwd, flops["fwd_bwd"])
            ctx.res.add(r)
            recs.append(r)
            ctx.log(describe(r))
        del prep
        gc.collect()
        if not ctx.dead:
            timing.empty_cache()
    del q, k, v, dout, lse_dense
    gc.collect()
    if not ctx.dead:
        timing.empty_cache()
    return recs


def section_guard(ctx, systems):
    """Every system against an fp32 reference on small shapes; flags failures."""
    ctx.log("guard: correctness of every system on small shapes (fp32 reference)")
    shapes = [("random", 0.0, 1, 1024, 8, 1, 128), ("synthetic", 4.0, 1, 1024, 8, 1, 128)]
    if "secondary" in ctx.args.sections.split(",") or "dist" in ctx.args.sections.split(","):
        shapes.append(("random", 0.0, 2, 512, 8, 8, 64))  # MHA and d = 64, for the secondary shapes
    if "fa4" in ctx.args.sections.split(","):
        shapes += [("random", 0.0, 1, 512, Hq, Hkv, d) for Hq, Hkv, d in FA4_SHAPES[1:]]
    for regime, sharp, B, N, Hq, Hkv, d in shapes:
        q, k, v, dout = common.make_inputs(regime, B, N, Hq, Hkv, d, sharp, seed=1)
        # fp32 reference from the same bf16-rounded inputs
        qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
        g = Hq // Hkv
        s = torch.einsum("bmhd,bnhd->bhmn", qf, kf.repeat_interleave(g, dim=2)) / math.sqrt(d)
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        lse_ref = torch.logsumexp(s, dim=-1).detach()
        o_ref = torch.einsum("bhmn,bnhd->bmhd", torch.softmax(s, dim=-1), vf.repeat_interleave(g, dim=2))
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (qf, kf, vf), dout.float())
        o_ref = o_ref.detach()
        # plain bf16 reference error (context for the kernels' errors)
        with torch.no_grad():
            sb = torch.einsum("bmhd,bnhd->bhmn", q, k.repeat_interleave(g, dim=2)) / math.sqrt(d)
            sb = sb.masked_fill(torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1), -math.inf)
            ob = torch.einsum("bhmn,bnhd->bmhd", torch.softmax(sb.float(), -1).to(q.dtype),
                              v.repeat_interleave(g, dim=2))
            bf16_err = common.rel_l2(ob, o_ref)
        for sysm in systems:
            rec = {"section": "guard", "system": sysm.name, "label": sysm.label, "tau": sysm.tau,
                   "regime": regime, "sharpness": sharp, "B": B, "N": N, "Hq": Hq, "Hkv": Hkv, "d": d,
                   "bf16_reference_rel_l2_o": bf16_err}
            why = system_ok(ctx, sysm)
            if why:
                rec.update(status="unavailable", reason=why)
                ctx.res.check(rec)
                ctx.log(f"guard {sysm.name:12s} {regime} N={N} d={d} Hkv={Hkv}: unavailable ({why[:120]})")
                continue
            try:
                fo = getattr(sysm, "forward_only", False)  # e.g. FlashInfer fmha_v2: O and lse only
                p = sysm.prepare(q, k, v, dout, need_grad=not fo)
                p.fwd() if fo else p.fwd_bwd()  # warm-up: compilation / autotuning happen here
                timing.sync()
                out, lse = sysm.outputs(q, k, v)
                grads = [None] * 3 if fo else sysm.grads_in_bnhd(p.fwd_bwd(), Hkv)
                rel = lambda x, r: float("nan") if x is None else common.rel_l2(x, r)  # noqa: E731
                rec.update(status="ok", rel_l2_o=common.rel_l2(out, o_ref), forward_only=fo,
                           rel_l2_dq=rel(grads[0], dq_ref), rel_l2_dk=rel(grads[1], dk_ref),
                           rel_l2_dv=rel(grads[2], dv_ref))
                if lse is not None:
                    mean, mx = common.omitted_mass(lse, lse_ref)
                    rec.update(omitted_mass_mean=mean, omitted_mass_max=mx)
                if sysm.sparse and sysm.tau and isinstance(sysm, S.Mala):
                    st, _ = sysm.stats(q, k, v, dout)
                    rec.update(st)
                flags = []
                if not sysm.tau and rec["rel_l2_o"] > 1e-2:
                    flags.append(f"rel L2 of O {rec['rel_l2_o']:.2e} > 1e-2 at tau=0")
                if sysm.tau and rec.get("omitted_mass_max") is not None and \
                        rec["omitted_mass_max"] > sysm.tau / (1 + sysm.tau) + 1e-4:
                    flags.append(f"omitted mass {rec['omitted_mass_max']:.3g} > tau/(1+tau)")
                if not sysm.tau and not fo:
                    for gname in ("dq", "dk", "dv"):
                        if rec[f"rel_l2_{gname}"] > 2e-2:
                            flags.append(f"rel L2 of {gname} {rec[f'rel_l2_{gname}']:.2e} > 2e-2 at tau=0")
                if any(not math.isfinite(rec[x]) for x in ("rel_l2_o",) + (() if fo else ("rel_l2_dq", "rel_l2_dk", "rel_l2_dv"))):
                    flags.append("non-finite output or gradient")
                if flags:
                    rec.update(flagged=True, flag_reason="; ".join(flags))
                    ctx.res.flagged[sysm.name] = "; ".join(flags)
                del p
            except Exception as e:  # noqa: BLE001
                st, why = _classify(e)
                rec.update(status=st, reason=why)
                if ctx.args.verbose:
                    traceback.print_exc()
                if not _cuda_alive():
                    ctx.dead = f"guard {sysm.name}: {why[:160]}"
            ctx.res.check(rec)
            msg = f"guard {sysm.name:12s} {regime}{'(s=%g)' % sharp if sharp else ''} B={B} N={N} d={d} Hkv={Hkv}: "
            if rec["status"] == "ok":
                msg += (f"rel L2 O {rec['rel_l2_o']:.2e} dQ {rec['rel_l2_dq']:.2e} dK {rec['rel_l2_dk']:.2e} "
                        f"dV {rec['rel_l2_dv']:.2e} (bf16 torch: O {bf16_err:.2e})")
                if rec.get("omitted_mass_max") is not None:
                    msg += f", omitted mass mean {rec['omitted_mass_mean']:.2e} max {rec['omitted_mass_max']:.2e}"
                if rec.get("fwd_slots_mean") is not None:
                    msg += (f", slots fwd {rec['fwd_slots_mean']:.0f} bwd {rec['bwd_slots_mean']:.0f},"
                            f" retained {100 * rec['fwd_retained_fraction']:.1f}%")
                if rec.get("flagged"):
                    msg += f"  FLAGGED: {rec['flag_reason']}"
            else:
                msg += f"{rec['status'].upper()}: {rec.get('reason', '')[:300]}"
            ctx.log(msg)
            if ctx.dead:
                return
        del q, k, v, dout, qf, kf, vf, s, o_ref
        gc.collect()
        timing.empty_cache()
    # decode against the fp32 reference
    for regime, sharp in (("random", 0.0), ("synthetic", 6.0)):
        B, N, Hq, Hkv, d = 2, 2048, 8, 1, 128
        q, k, v, _ = common.make_inputs(regime, B, N, Hq, Hkv, d, sharp, seed=2, with_dout=False)
        q1 = q[:, -1:].contiguous()
        qf, kf, vf = q1.float(), k.float().repeat_interleave(Hq, 2), v.float().repeat_interleave(Hq, 2)
        s = torch.einsum("bmhd,bnhd->bhmn", qf, kf) / math.sqrt(d)
        lse_ref = torch.logsumexp(s, -1)
        o_ref = torch.einsum("bhmn,bnhd->bmhd", torch.softmax(s, -1), vf)
        for sysm in systems:
            rec = {"section": "guard", "op": "decode", "system": sysm.name, "label": sysm.label, "tau": sysm.tau,
                   "regime": regime, "sharpness": sharp, "B": B, "N": N, "Hq": Hq, "Hkv": Hkv, "d": d}
            why = system_ok(ctx, sysm)
            if why:
                rec.update(status="unavailable", reason=why)
                ctx.res.check(rec)
                continue
            try:
                p = sysm.prepare_decode(q1, k, v)
                p.decode()
                if hasattr(p, "out_lse"):
                    out, lse = p.out_lse()
                    mean, mx = common.omitted_mass(lse, lse_ref)
                    rec.update(omitted_mass_mean=mean, omitted_mass_max=mx)
                else:
                    out = p.out()
                rec.update(status="ok", rel_l2_o=common.rel_l2(out, o_ref))
                if hasattr(p, "stats"):
                    rec.update(p.stats())
                flags = []
                if not sysm.tau and rec["rel_l2_o"] > 1e-2:
                    flags.append(f"decode rel L2 of O {rec['rel_l2_o']:.2e} > 1e-2 at tau=0")
                if sysm.tau and rec.get("omitted_mass_max") is not None and \
                        rec["omitted_mass_max"] > sysm.tau / (1 + sysm.tau) + 1e-4:
                    flags.append(f"decode omitted mass {rec['omitted_mass_max']:.3g} > tau/(1+tau)")
                if flags:
                    rec.update(flagged=True, flag_reason="; ".join(flags))
                    ctx.res.flagged[sysm.name + ":decode"] = "; ".join(flags)
            except Exception as e:  # noqa: BLE001
                st, why = _classify(e)
                rec.update(status=st, reason=why)
                if not _cuda_alive():
                    ctx.dead = f"guard decode {sysm.name}: {why[:160]}"
            ctx.res.check(rec)
            msg = f"guard {sysm.name:12s} decode {regime} B={B} N={N}: "
            if rec["status"] == "ok":
                msg += f"rel L2 O {rec['rel_l2_o']:.2e}"
                if rec.get("omitted_mass_max") is not None:
                    msg += f", omitted mass max {rec['omitted_mass_max']:.2e}"
                if rec.get("fwd_slots_mean") is not None:
                    msg += f", slots {rec['fwd_slots_mean']:.0f}, retained {100 * rec['fwd_retained_fraction']:.1f}%"
                if rec.get("flagged"):
                    msg += f"  FLAGGED: {rec['flag_reason']}"
            else:
                msg += f"{rec['status'].upper()}: {rec.get('reason', '')[:300]}"
            ctx.log(msg)
            if ctx.dead:
                return
    # the mala package's own generator, when it has one, against ours
    fn = None
    try:
        import workloads
        fn = workloads.mala_make_workload()
    except Exception:  # noqa: BLE001
        pass
    status = common.workloads.cpp_source_status()
    ctx.log(f"generator port vs src/workload.cpp: {status}")
    if fn is None:
        ctx.res.note("inputs: lab/suite/workloads.py (re-implementation of src/workload.cpp; "
                     "lab/suite/check_generator.py compares them bit for bit); the mala package exposes "
                     f"no make_workload binding; port status: {status}")
    else:
        try:
            theirs = fn(regime="synthetic", batch=1, seqlen=1024, heads_q=8, heads_kv=1, head_dim=128,
                        sharpness=16.0, seed=3)
            mine = common.workloads.make_workload("synthetic", 1, 1024, 8, 1, 128, 16.0, 3, device=timing.DEVICE)
            diffs = [float((a.float().to(b.device) - b.reshape(a.shape)).abs().max()) for a, b in zip(theirs, mine)]
            ctx.res.note(f"inputs: lab/suite/workloads.py; mala.make_workload max |diff| per tensor {diffs}; "
                         f"port status: {status}")
            ctx.log(f"generator vs mala.make_workload: max |diff| {diffs}")
        except Exception as e:  # noqa: BLE001
            ctx.res.note(f"inputs: lab/suite/workloads.py; mala.make_workload comparison failed: {e}; "
                         f"port status: {status}")


def section_primary(ctx, systems):
    ns = ctx.args.ns or ctx.cfg["primary_ns"]
    ctx.log(f"primary: Hq=8 Hkv=1 d=128 bf16 causal B=1 random, N = {ns} K")
    for n in ns:
        bench_training_shape(ctx, "primary", systems, "random", 0.0, 1, n * KI, 8, 1, 128, ctx.cfg["ops"])


def section_secondary(ctx, systems):
    ns = ctx.cfg["secondary_ns"]
    ctx.log(f"secondary: d=64 (Hq=8 Hkv=1) and MHA (Hq=Hkv=8 d=128), random, N = {ns} K")
    for n in ns:
        for Hq, Hkv, d in ((8, 1, 64), (8, 8, 128)):
            bench_training_shape(ctx, "secondary", systems, "random", 0.0, 1, n * KI, Hq, Hkv, d, ctx.cfg["ops"])


def section_fa4(ctx, systems):
    ns = ctx.cfg["fa4_ns"]
    ops = [op for op in ctx.cfg["ops"] if op in ("fwd", "bwd")]
    ctx.log(f"fa4: (Hq, Hkv, d) in {FA4_SHAPES}, random, N = {ns} K, ops {ops}")
    for n in ns:
        for Hq, Hkv, d in FA4_SHAPES:
            bench_training_shape(ctx, "fa4", systems, "random", 0.0, 1, n * KI, Hq, Hkv, d, ops)


def section_decode(ctx, systems):
    ns, batches = ctx.cfg["decode_ns"], ctx.cfg["decode_batches"]
    sharp_dec = ctx.cfg["decode_sharpness"]
    ctx.log(f"decode: 1 token, Hq=8 Hkv=1 d=128, batch {batches}, cache N = {ns} K, random and synthetic(s={sharp_dec:g})")
    Hq, Hkv, d = 8, 1, 128
    for regime, sharp in (("random", 0.0), ("synthetic", sharp_dec)):
        for B in batches:
            for n in ns:
                N = n * KI
                if ctx.dead:
                    break
                try:
                    q, k, v, _ = common.make_inputs(regime, B, N, Hq, Hkv, d, sharp, seed=4, with_dout=False)
                except Exception as e:  # noqa: BLE001
                    ctx.log(f"decode inputs failed: {e}")
                    continue
                q1 = q[:, -1:].contiguous()  # the last position's query: it sees all N cached keys
                del q
                lse_dense = None
                if any(s.sparse for s in systems):
                    try:
                        lse_dense = common.dense_lse(q1, k, v, causal=False)
                    except Exception as e:  # noqa: BLE001
                        ctx.log(f"dense lse failed: {e}")
                kv_bytes = 2 * k.numel() * k.element_size()
                flops = timing.causal_flops_fwd(B, 1, N, Hq, d)
                for sysm in systems:
                    r = base_rec("decode", "decode", sysm, regime, sharp, B, N, Hq, Hkv, d)
                    why = system_ok(ctx, sysm)
                    if why:
                        r.update(status="unavailable", reason=why)
                    else:
                        try:
                            p = sysm.prepare_decode(q1, k, v)
                            if sysm.sparse and sysm.tau:
                                try:
                                    p.decode()
                                    if hasattr(p, "stats"):
                                        r.update(p.stats())
                                    _, lse = p.out_lse()
                                    mean, mx = common.omitted_mass(lse, lse_dense)
                                    r.update(omitted_mass_mean=mean, omitted_mass_max=mx)
                                    if mx is not None and mx > sysm.tau / (1 + sysm.tau) + 1e-4:
                                        r.update(flagged=True, flag_reason=f"omitted mass {mx:.3g} > tau/(1+tau)")
                                except Exception as e:  # noqa: BLE001
                                    r["stats_error"] = _classify(e)[1]
                            run_measure(ctx, r, ("decode", sysm.name, B, regime), p.decode, flops, kv_bytes)
                            del p
                        except Exception as e:  # noqa: BLE001
                            st, why2 = _classify(e)
                            r.update(status=st, reason="prepare: " + why2)
                    ctx.res.add(r)
                    ctx.log(describe(r))
                del q1, k, v, lse_dense
                gc.collect()
                if not ctx.dead:
                    timing.empty_cache()


def calibrate(ctx, N, tau, candidates):
    """Rule-model retained fraction (2 of the 8 query heads) per candidate sharpness at N."""
    out = []
    for s in candidates:
        if ctx.left() < 10:
            ctx.log(f"calibrate N={N}: stopped at the time budget")
            break
        q, k, _, _ = common.make_inputs("synthetic" if s else "random", 1, N, 2, 1, 128, s, seed=0,
                                        with_dout=False)
        rf = rule_model.forward_rule(q, k, tau)["retained_fraction"]
        out.append((s, rf))
        ctx.log(f"calibrate N={N} sharpness {s:g}: rule-model retained {100 * rf:.2f}%")
        del q, k
    ctx.res.data.setdefault("calibration", []).append({"N": N, "tau": tau, "points": out})
    ctx.res.save()
    return out


def section_real(ctx, systems):
    """Captured states of a real model (lab/real/qwen_measure.py's save step, or capture_qkv.py):
    every op of every system on each --real PREFIX at each --real-ns length (default: all rows)."""
    for prefix in ctx.args.real:
        N_cap, Hq, Hkv, d = common.real_shape(prefix)
        for N in (ctx.args.real_ns or [N_cap]):
            if N > N_cap:
                ctx.log(f"real: {prefix} has {N_cap} rows, N={N} skipped")
                continue
            ctx.log(f"real: {prefix} N={N} Hq={Hq} Hkv={Hkv} d={d}")
            bench_training_shape(ctx, "real", systems, "real:" + prefix, 0.0, 1, N, Hq, Hkv, d, ctx.cfg["ops"])


CALIBRATION_CANDIDATES = [0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 10.0, 16.0]


def section_calibrate(ctx, systems):
    """Rule-model retained fraction vs sharpness at the sweep's sequence lengths (no timing)."""
    for n in (ctx.args.sweep_ns or ctx.cfg["sweep_ns"]):
        pts = calibrate(ctx, n * KI, ctx.args.tau, ctx.args.sharpness or CALIBRATION_CANDIDATES)
        ctx.log(f"calibrate N={n}K: " + ", ".join(f"s={s:g}: {100 * f:.2f}%" for s, f in pts))


def section_sweep(ctx, systems):
    tau = ctx.args.tau
    sparse = [s for s in systems if s.sparse and s.tau]
    dense = [s for s in systems if s.name in ("sdpa_flash", "sdpa_cudnn")]
    ops = ctx.cfg["sweep_ops"]
    for n in (ctx.args.sweep_ns or ctx.cfg["sweep_ns"]):
        N = n * KI
        grid = ctx.args.sharpness or SWEEP_SHARPNESS.get(n, SWEEP_SHARPNESS["default"])
        if ctx.args.calibrate:
            pts = calibrate(ctx, N, tau, CALIBRATION_CANDIDATES)
            grid = _pick(pts, [1.0, 0.7, 0.4, 0.2, 0.1, 0.05, 0.02]) or grid
        ctx.log(f"sweep: N={N} synthetic sharpness {grid}, tau={tau:g}, ops {ops}, "
                f"systems {[s.name for s in sparse + dense]}")
        dense_n = _fastest_dense(ctx, dense, N, ops)
        mala_ok = any(isinstance(s, S.Mala) and not system_ok(ctx, s) for s in sparse)
        for sharp in grid:
            regime = "synthetic" if sharp else "random"
            bench_training_shape(ctx, "sweep", sparse + dense_n, regime, sharp, 1, N, 8, 1, 128, ops,
                                 extra={"rule_model": not mala_ok})


def _fastest_dense(ctx, dense, N, ops):
    """The dense systems to run on every sweep input: both SDPA backends, unless this run's primary
    section already showed one of them fastest at this N for every swept operator (then that one
    alone, to save time at long N)."""
    if not dense:
        return dense
    prim = [r for r in ctx.res.data["records"] if r["section"] == "primary" and r["N"] == N
            and r["status"] == "ok" and r["system"] in [d.name for d in dense]]
    best = set()
    for op in ops:
        rs = [r for r in prim if r["op"] == op]
        if len(rs) < len(dense):
            return dense
        best.add(min(rs, key=lambda r: r["ms"])["system"])
    if len(best) == 1:
        name = best.pop()
        ctx.log(f"sweep N={N}: dense baseline {name} (fastest in this run's primary section at this N)")
        return [d for d in dense if d.name == name]
    return dense


def _pick(points, targets):
    if not points:
        return None
    chosen = []
    for t in targets:
        s, _ = min(points, key=lambda p: abs(math.log(max(p[1], 1e-6)) - math.log(t)))
        if s not in chosen:
            chosen.append(s)
    return sorted(chosen)


# ---- main ---------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small subset (validation, a few minutes)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_suite_out")
    ap.add_argument("--sections", default="guard,primary,decode,sweep,secondary")
    ap.add_argument("--systems", default=None,
                    help="sdpa_flash,sdpa_cudnn,flex,fsa,fsa0,mala,mala0,fa4,flashinfer,flashinfer_skip_softmax"
                         " (fsa/mala at --tau, flashinfer_skip_softmax at --fi-scale-factors); default "
                         + ",".join(DEFAULT_SYSTEMS) + " (--dist: sdpa_flash,sdpa_cudnn,fsa,mala,mala0)")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--fi-scale-factors", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="flashinfer_skip_softmax's threshold scale factors (lambda = sf / N); default --tau")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="primary sequence lengths in K tokens (overrides the preset)")
    ap.add_argument("--decode-ns", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--secondary-ns", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--fa4-ns", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="the fa4 section's sequence lengths in K tokens (default 8,32,128; --quick 8)")
    ap.add_argument("--sweep-ns", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--sharpness", type=lambda s: [float(x) for x in s.split(",")], default=None)
    ap.add_argument("--calibrate", action="store_true", help="choose the sweep's sharpness with the rule model")
    ap.add_argument("--ops", default=None, help="fwd,bwd,fwd_bwd (overrides the preset)")
    ap.add_argument("--min-reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("MALA_BENCH_BUDGET_S", 540)))
    ap.add_argument("--deadline", type=float, default=float(os.environ.get("MALA_BENCH_DEADLINE", 0)) or None,
                    help="absolute time (epoch s) by which everything must be written")
    ap.add_argument("--dist", type=int, default=0, help="tensor-parallel mode over this many GPUs (issue 6)")
    ap.add_argument("--dist-rank-heads", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                    metavar="HQ,HKV", help="--dist: heads per rank (default 64/W query, 8/W KV heads)")
    ap.add_argument("--real", type=lambda s: s.split(","), default=[],
                    help="section real: captured states PREFIX[,PREFIX...] (files PREFIX_{q,k,v}.npy)")
    ap.add_argument("--real-ns", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="section real: sequence lengths (first N rows; default all rows)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: smoke test of the suite itself (no GPU numbers)")
    args = ap.parse_args()

    if args.dist:
        import dist
        return dist.main(args)

    cfg = dict(QUICK if args.quick else FULL)
    if args.ops:
        cfg["ops"] = args.ops.split(",")
    if args.decode_ns:
        cfg["decode_ns"] = args.decode_ns
    if args.secondary_ns:
        cfg["secondary_ns"] = args.secondary_ns
    if args.fa4_ns:
        cfg["fa4_ns"] = args.fa4_ns
    os.makedirs(args.out, exist_ok=True)
    timing.DEVICE = args.device
    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = common.env_info(S)
    meta["generator"] = "lab/suite/workloads.py: " + common.workloads.cpp_source_status()
    meta.update(mode="quick" if args.quick else "full", argv=sys.argv[1:], config=cfg,
                timing="CUDA events around each call, 256 MiB L2 flush before each, median of >= "
                       f"{args.min_reps} after warm-up",
                flops="dense-equivalent: fwd 4*Nq*Nk_visible_avg*d*Hq*B, bwd 2.5x, fwd+bwd 3.5x")
    res = common.Results(os.path.join(args.out, "results.json"), meta)
    ctx = Ctx(args, cfg, res)
    ctx.log(f"device {meta.get('device')} driver {meta.get('driver')} torch {meta['torch']} "
            f"CUDA {meta['cuda_runtime']} cuDNN {meta['cudnn']} triton {meta['triton']} commit {meta['git_commit']}")
    ctx.log(f"mala: {meta.get('mala')}")
    ctx.log(f"flash_sparse_attn: {meta.get('flash_sparse_attn')}")
    ctx.log(f"time budget: {ctx.deadline - time.time():.0f}s (reserve {RESERVE_S:.0f}s for outputs)")
    systems = S.all_systems((args.systems or ",".join(DEFAULT_SYSTEMS)).split(","), taus=(args.tau,),
                            fi_scale_factors=args.fi_scale_factors)
    sections = args.sections.split(",")
    funcs = {"calibrate": section_calibrate, "guard": section_guard, "primary": section_primary, "decode": section_decode,
             "sweep": section_sweep, "secondary": section_secondary, "fa4": section_fa4, "real": section_real}
    for sec in sections:
        if sec not in funcs:
            raise SystemExit(f"unknown section {sec}")
        if ctx.dead:
            ctx.log(f"{sec}: skipped (CUDA context lost: {ctx.dead})")
            res.note(f"section {sec} skipped: CUDA context lost ({ctx.dead})")
            continue
        if ctx.left() <= 0:
            ctx.log(f"{sec}: skipped (time budget)")
            res.note(f"section {sec} skipped: time budget")
            continue
        t = time.time()
        try:
            funcs[sec](ctx, systems)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res.note(f"section {sec} aborted: {_classify(e)[1]}")
            if not _cuda_alive():
                ctx.dead = f"section {sec}: {e}"
        ctx.log(f"{sec}: done in {time.time() - t:.0f}s")
    res.data["meta"]["wall_s"] = ctx.elapsed()
    res.save()
    if not args.no_plots:
        try:
            import plots
            made = plots.make_all(res.data, args.out)
            ctx.log(f"plots: {made}")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            ctx.log(f"plots failed: {e}")
    try:
        import report
        text = report.summary_markdown([res.data])
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(text)
        print(report.summary_text(res.data), flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ctx.log(f"summary failed: {e}")
    ctx.log(f"wrote {args.out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

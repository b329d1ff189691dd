#!/usr/bin/env python3
"""Summary, confidence intervals, tables and plots of a qwen_measure.py run (docs/real.md).

    python3 lab/real/qwen_report.py bench/results/real/qwen_raw.json --out bench/results/real

Writes OUT/qwen_states.json (the summary: per length the means, P95s and their bootstrap CIs, and
the whole-model times), OUT/qwen_text_files.txt (every source file with its SHA-256), OUT/qwen_tables.md (the tables docs/real.md shows) and, when matplotlib is
installed, OUT/qwen_lengths.png, OUT/qwen_retained_map.png, OUT/qwen_tau_sweep.png.

Statistics: a unit is one (sequence, layer, query head) (one KV head for dK and dV).  Each unit
gives one number per metric (its mean over rows for slots and omitted mass; its relative L2 error
over the head's rows for O, dQ, dK, dV); a length reports the mean and the 95th percentile over its
units, each with a 95% percentile-bootstrap interval (units resampled with replacement, 2000 draws,
fixed seed).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

METRICS = ("fwd_slots", "bwd_slots", "fwd_retained", "bwd_retained", "omitted_mean", "omitted_p95",
           "omitted_max", "o_err", "dq_err", "dk_err", "dv_err")


def bootstrap_ci(values, stat=np.mean, n_boot=2000, level=0.95, seed=0):
    """(low, high) percentile-bootstrap interval of stat over values (1-D; resampled whole)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    draws = np.array([stat(x[i]) for i in idx])
    a = (1.0 - level) / 2.0
    return (float(np.quantile(draws, a)), float(np.quantile(draws, 1.0 - a)))


def p95(x):
    return float(np.quantile(np.asarray(x, dtype=np.float64), 0.95))


def describe_units(values):
    """mean, P95 and their bootstrap intervals of per-unit values."""
    x = np.asarray(values, dtype=np.float64).ravel()
    return {"mean": float(x.mean()), "mean_ci": bootstrap_ci(x), "p95": p95(x),
            "p95_ci": bootstrap_ci(x, stat=p95), "n_units": int(x.size)}


def speed_sums(speed_n):
    """Whole-model sums over layers: {system: {"fwd": ms, "bwd": ms}}."""
    return {k: {"fwd": float(np.sum(v["fwd_ms"])), "bwd": float(np.sum(v["bwd_ms"])), "layers": len(v["fwd_ms"])}
            for k, v in speed_n.items()}


def summarize(raw):
    st = raw["states"]
    out = {"model": raw["model"]["name"], "model_file": raw["model"]["file"],
           "text": {"source": raw["text"]["source"], "python": raw["text"]["python"],
                    "sequences": [s["package"] for s in raw["text"]["sequences"]],
                    "tokens_per_sequence": raw["text"]["n_tokens"]},
           "device": raw["device"], "torch": raw["torch"], "mala_commit": raw["mala_commit"], "date": raw["date"],
           "tau": raw["args"]["tau"], "tiles": st.get("tiles"), "lengths": {}}
    for n, rec in sorted(st["lengths"].items(), key=lambda kv: int(kv[0])):
        d = {k: describe_units(rec[k]) for k in METRICS if k in rec}
        L = {"sequences": len(rec["fwd_slots"]), "dense_slots_mean": (int(n) + 1) / 2.0}
        L.update({
            "fwd_slots_mean": d["fwd_slots"]["mean"], "bwd_slots_mean": d["bwd_slots"]["mean"],
            "fwd_retained": d["fwd_retained"]["mean"], "bwd_retained": d["bwd_retained"]["mean"],
            "omitted_mass_mean": d["omitted_mean"]["mean"], "omitted_mass_p95": d["omitted_mean"]["p95"],
            "omitted_mass_row_p95_mean": d["omitted_p95"]["mean"], "omitted_mass_row_max": float(np.max(rec["omitted_max"])),
            "o_err_mean": d["o_err"]["mean"], "dq_err_mean": d["dq_err"]["mean"],
            "dk_err_mean": d["dk_err"]["mean"], "dv_err_mean": d["dv_err"]["mean"],
            "o_err_p95": d["o_err"]["p95"], "dq_err_p95": d["dq_err"]["p95"],
            "dk_err_p95": d["dk_err"]["p95"], "dv_err_p95": d["dv_err"]["p95"],
            "units": d,
        })
        if n in st.get("loss", {}):
            lo = st["loss"][n]
            L["loss_mean"] = float(np.mean(lo["mean"][:L["sequences"]]))
            L["loss_last_half"] = float(np.mean(lo["last_half"][:L["sequences"]]))
        if n in raw.get("speed", {}):
            s = speed_sums(raw["speed"][n])
            L["fwd_ms"] = {k: v["fwd"] for k, v in s.items()}
            L["bwd_ms"] = {k: v["bwd"] for k, v in s.items()}
            L["speed_layers"] = min(v["layers"] for v in s.values())
        out["lengths"][n] = L
    if st.get("sweep"):
        n, sw = max(st["sweep"].items(), key=lambda kv: int(kv[0]))
        out["tau_sweep"] = {"N": int(n), "points": {
            t: {"fwd_retained": float(np.mean(v["fwd_retained"])), "fwd_slots": float(np.mean(v["fwd_slots"])),
                "bwd_retained": float(np.mean(v["bwd_retained"])), "omitted_mass_mean": float(np.mean(v["omitted_mean"])),
                "omitted_mass_row_max": float(np.max(v["omitted_max"])), "bound": float(t) / (1.0 + float(t)),
                "o_err_mean": float(np.mean(v["o_err"])), "dq_err_mean": float(np.mean(v["dq_err"])),
                "dk_err_mean": float(np.mean(v["dk_err"])), "dv_err_mean": float(np.mean(v["dv_err"]))}
            for t, v in sorted(sw.items(), key=lambda kv: float(kv[0]))}}
    if raw.get("decode"):
        out["decode"] = {b: {"cache_len": r["cache_len"], "whole_model_us": r["whole_model_us"],
                             "fwd_retained": float(np.mean(r["fwd_retained"])), "fwd_slots": float(np.mean(r["fwd_slots"])),
                             "omitted_mass_mean": float(np.mean(r["omitted_mean"])),
                             "o_err_mean": float(np.mean(r["o_err"])), "num_splits": r["num_splits"]}
                         for b, r in raw["decode"].items()}
    if raw.get("checks"):
        out["checks"] = raw["checks"]
    return out


def tables(summary, raw):
    """Markdown tables for docs/real.md."""
    L = summary["lengths"]
    ns = sorted(L, key=int)
    f = lambda d, k: f"{d['units'][k]['mean']:.4f} [{d['units'][k]['mean_ci'][0]:.4f}, {d['units'][k]['mean_ci'][1]:.4f}]"  # noqa: E731
    g = lambda d, k: f"{d['units'][k]['p95']:.4f} [{d['units'][k]['p95_ci'][0]:.4f}, {d['units'][k]['p95_ci'][1]:.4f}]"  # noqa: E731
    rows = ["| N | loss (all / last half) | fwd slots/query (dense) | bwd slots/query | fwd retained | bwd retained |",
            "|---|---|---|---|---|---|"]
    for n in ns:
        d = L[n]
        rows.append(f"| {int(n) // 1024}K | {d.get('loss_mean', float('nan')):.3f} / {d.get('loss_last_half', float('nan')):.3f} "
                    f"| {d['fwd_slots_mean']:.0f} ({d['dense_slots_mean']:.0f}) | {d['bwd_slots_mean']:.0f} "
                    f"| {100 * d['fwd_retained']:.1f}% | {100 * d['bwd_retained']:.1f}% |")
    work = "\n".join(rows)
    rows = ["| N | omitted mass, mean | P95 | O err, mean | P95 | dQ err, mean | P95 | dK err, mean | dV err, mean |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n in ns:
        d = L[n]
        rows.append(f"| {int(n) // 1024}K | {f(d, 'omitted_mean')} | {g(d, 'omitted_mean')} | {f(d, 'o_err')} | "
                    f"{g(d, 'o_err')} | {f(d, 'dq_err')} | {g(d, 'dq_err')} | {f(d, 'dk_err')} | {f(d, 'dv_err')} |")
    fid = "\n".join(rows)
    rows = ["| N | fwd: MALA tau=1 / tau=0 / cuDNN (ms) | tau=1 vs tau=0 | vs cuDNN | bwd: MALA tau=1 / tau=0 / cuDNN (ms) | tau=1 vs tau=0 | vs cuDNN |",
            "|---|---|---|---|---|---|---|"]
    for n in ns:
        d = L[n]
        if "fwd_ms" not in d:
            continue
        a, b = d["fwd_ms"], d["bwd_ms"]
        rows.append(f"| {int(n) // 1024}K | {a['mala_tau1']:.2f} / {a['mala_tau0']:.2f} / {a['cudnn']:.2f} | "
                    f"{a['mala_tau0'] / a['mala_tau1']:.3f}x | {a['cudnn'] / a['mala_tau1']:.3f}x | "
                    f"{b['mala_tau1']:.2f} / {b['mala_tau0']:.2f} / {b['cudnn']:.2f} | "
                    f"{b['mala_tau0'] / b['mala_tau1']:.3f}x | {b['cudnn'] / b['mala_tau1']:.3f}x |")
    speed = "\n".join(rows)
    out = {"work": work, "fidelity": fid, "speed": speed}
    if "tau_sweep" in summary:
        rows = ["| tau | fwd retained | fwd slots/query | bwd retained | omitted mass, mean | row max (bound) | O err | dQ err | dK err | dV err |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for t, p in summary["tau_sweep"]["points"].items():
            rows.append(f"| {t} | {100 * p['fwd_retained']:.1f}% | {p['fwd_slots']:.0f} | {100 * p['bwd_retained']:.1f}% | "
                        f"{p['omitted_mass_mean']:.4f} | {p['omitted_mass_row_max']:.3f} ({p['bound']:.3f}) | "
                        f"{p['o_err_mean']:.4f} | {p['dq_err_mean']:.4f} | {p['dk_err_mean']:.4f} | {p['dv_err_mean']:.4f} |")
        out["sweep"] = "\n".join(rows)
    if "decode" in summary:
        rows = ["| batch | MALA tau=1 (us) | MALA tau=0 (us) | SDPA flash (us) | tau=1 vs tau=0 | retained | slots/query | splits |",
                "|---|---|---|---|---|---|---|---|"]
        for bsz, r in summary["decode"].items():
            us = r["whole_model_us"]
            ratio = us["mala_tau0"] / us["mala_tau1"] if us.get("mala_tau0") and us.get("mala_tau1") else float("nan")
            fmt = lambda x: f"{x:.1f}" if x else "failed"  # noqa: E731
            rows.append(f"| {bsz} | {fmt(us.get('mala_tau1'))} | {fmt(us.get('mala_tau0'))} | {fmt(us.get('sdpa_flash'))} | "
                        f"{ratio:.3f}x | {100 * r['fwd_retained']:.1f}% | {r['fwd_slots']:.0f} | {r['num_splits']} |")
        out["decode"] = "\n".join(rows)
    # per-layer table at the longest length
    n = ns[-1]
    rec = raw["states"]["lengths"][n]
    fr = np.asarray(rec["fwd_retained"]).mean(axis=0)  # [layer, head]
    dq = np.asarray(rec["dq_err"]).mean(axis=0)
    oe = np.asarray(rec["o_err"]).mean(axis=0)
    rows = ["| layer | fwd retained (mean, min..max over heads) | O err | dQ err | fwd ms tau=1 / tau=0 / cuDNN | bwd ms tau=1 / tau=0 / cuDNN |",
            "|---|---|---|---|---|---|"]
    sp = raw.get("speed", {}).get(n)
    for li in range(fr.shape[0]):
        t = ""
        if sp and li < len(sp["mala_tau1"]["fwd_ms"]):
            t = (f"{sp['mala_tau1']['fwd_ms'][li]:.3f} / {sp['mala_tau0']['fwd_ms'][li]:.3f} / {sp['cudnn']['fwd_ms'][li]:.3f} | "
                 f"{sp['mala_tau1']['bwd_ms'][li]:.3f} / {sp['mala_tau0']['bwd_ms'][li]:.3f} / {sp['cudnn']['bwd_ms'][li]:.3f}")
        else:
            t = " | "
        rows.append(f"| {li} | {100 * fr[li].mean():.1f}% ({100 * fr[li].min():.1f}..{100 * fr[li].max():.1f}) | "
                    f"{oe[li].mean():.4f} | {dq[li].mean():.4f} | {t} |")
    out["layers"] = "\n".join(rows)
    return out


def plots(summary, raw, outdir):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = summary["lengths"]
    ns = sorted(L, key=int)
    x = [int(n) for n in ns]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    for key, lab in (("fwd_slots", "forward"), ("bwd_slots", "backward")):
        m = [L[n]["units"][key]["mean"] for n in ns]
        lo = [L[n]["units"][key]["mean_ci"][0] for n in ns]
        hi = [L[n]["units"][key]["mean_ci"][1] for n in ns]
        ax[0].errorbar(x, m, yerr=[np.subtract(m, lo), np.subtract(hi, m)], marker="o", capsize=3, label=f"MALA {lab}")
    ax[0].plot(x, [L[n]["dense_slots_mean"] for n in ns], "k--", label="dense (mean visible keys)")
    ax[0].axhline(1024, color="gray", ls=":", label="paper's 14B model (~1,024)")
    ax[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel="post-score key slots per query",
              title=f"Work at tau = {summary['tau']:g}")
    ax[0].legend(fontsize=8)
    for key, lab in (("o_err", "O"), ("dq_err", "dQ"), ("dk_err", "dK"), ("dv_err", "dV")):
        m = [L[n]["units"][key]["mean"] for n in ns]
        lo = [L[n]["units"][key]["mean_ci"][0] for n in ns]
        hi = [L[n]["units"][key]["mean_ci"][1] for n in ns]
        ax[1].errorbar(x, m, yerr=[np.subtract(m, lo), np.subtract(hi, m)], marker="o", capsize=3, label=f"{lab} mean")
        ax[1].plot(x, [L[n]["units"][key]["p95"] for n in ns], ls=":", marker=".", label=f"{lab} P95")
    ax[1].set(xscale="log", yscale="log", xlabel="tokens", ylabel="relative L2 error vs tau = 0",
              title="Operator fidelity (units: sequence x layer x head)")
    ax[1].legend(fontsize=7, ncol=2)
    sx = [int(n) for n in ns if "fwd_ms" in L[n]]
    if sx:
        sn = [n for n in ns if "fwd_ms" in L[n]]
        for op in ("fwd", "bwd"):
            ax[2].plot(sx, [L[n][f"{op}_ms"]["mala_tau0"] / L[n][f"{op}_ms"]["mala_tau1"] for n in sn], marker="o",
                       label=f"{op}: tau=1 vs our tau=0")
            ax[2].plot(sx, [L[n][f"{op}_ms"]["cudnn"] / L[n][f"{op}_ms"]["mala_tau1"] for n in sn], marker="s", ls="--",
                       label=f"{op}: tau=1 vs cuDNN")
        ax[2].axhline(1.0, color="k", lw=0.8)
        ax[2].set(xscale="log", xlabel="tokens", ylabel="speedup (whole model, sum over layers)",
                  title=f"Speed ({summary['device']})")
        ax[2].legend(fontsize=8, loc="center right")
    for a in ax:
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.set_xticks(x)
        a.set_xticklabels([f"{v // 1024}K" for v in x])
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "qwen_lengths.png"), dpi=110)
    plt.close(fig)

    n = ns[-1]
    fr = np.asarray(raw["states"]["lengths"][n]["fwd_retained"]).mean(axis=0)
    br = np.asarray(raw["states"]["lengths"][n]["bwd_retained"]).mean(axis=0)
    fig, ax = plt.subplots(1, 2, figsize=(12, 6))
    for a, m, t in ((ax[0], fr, "forward"), (ax[1], br, "backward")):
        im = a.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        a.set(xlabel="query head", ylabel="layer", title=f"{t} retained tile fraction, N = {int(n) // 1024}K, tau = {summary['tau']:g}")
        fig.colorbar(im, ax=a)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "qwen_retained_map.png"), dpi=110)
    plt.close(fig)

    if "tau_sweep" in summary:
        pts = summary["tau_sweep"]["points"]
        ts = list(pts)
        fig, ax = plt.subplots(figsize=(6.5, 4.6))
        for key, lab in (("o_err_mean", "O"), ("dq_err_mean", "dQ"), ("dk_err_mean", "dK"), ("dv_err_mean", "dV")):
            xs = [pts[t]["fwd_retained"] for t in ts]
            ys = [pts[t][key] for t in ts]
            ax.plot(xs, ys, marker="o", label=lab)
            if key == "o_err_mean":
                for t, xx, yy in zip(ts, xs, ys):
                    ax.annotate(f"tau={t}", (xx, yy), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel="forward retained tile fraction", ylabel="mean relative L2 error vs tau = 0", yscale="log",
               title=f"Work against error, N = {summary['tau_sweep']['N'] // 1024}K")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "qwen_tau_sweep.png"), dpi=110)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args()
    with open(a.raw) as f:
        raw = json.load(f)
    os.makedirs(a.out, exist_ok=True)
    s = summarize(raw)
    with open(os.path.join(a.out, "qwen_states.json"), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(a.out, "qwen_text_files.txt"), "w") as f:
        tx = raw["text"]
        f.write(f"# {tx['source']}, Python {tx['python']} ({tx['root']}); one package per sequence, files in order,\n"
                f"# each preceded by '# file: <path>', tokenized, cut at {tx['n_tokens']} tokens (tokens_used).\n"
                "# sequence package sha256 path bytes tokens_used\n")
        for i, sq in enumerate(tx["sequences"]):
            for fl in sq["files"]:
                f.write(f"{i} {sq['package']} {fl['sha256']} {fl['path']} {fl['bytes']} {fl['tokens_used']}\n")
    t = tables(s, raw)
    with open(os.path.join(a.out, "qwen_tables.md"), "w") as f:
        for k, v in t.items():
            f.write(f"### {k}\n\n{v}\n\n")
    print(open(os.path.join(a.out, "qwen_tables.md")).read())
    if not a.no_plots:
        try:
            plots(s, raw, a.out)
        except ImportError as e:
            print(f"qwen_report: no plots ({e})")


if __name__ == "__main__":
    main()

"""Plots of a results.json (matplotlib, Agg): each PNG kept under 300 KB.

    python3 lab/suite/plots.py RESULTS.json [OUTDIR]

latency_primary.png    latency vs sequence length per operator (fwd, bwd, fwd+bwd), log-log
latency_decode.png     decode latency vs cache length (batch 1 and 8; random and synthetic inputs)
latency_secondary.png  the secondary shapes (d=64, MHA)
speedup_sweep.png      speedup over the fastest dense baseline on the same input vs the retained
                       fraction of MALA's forward (or backward) tiles, one panel per (N, operator)
latency_dist.png       tensor-parallel run: synchronized group latency vs sequence length
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401

STYLE = {
    "sdpa_flash": dict(color="tab:blue", marker="o"),
    "sdpa_cudnn": dict(color="tab:green", marker="s"),
    "flex": dict(color="tab:purple", marker="^"),
    "mala_tau0": dict(color="tab:gray", marker="x"),
}
OPS = [("fwd", "forward"), ("bwd", "backward"), ("fwd_bwd", "forward + backward")]
MAX_BYTES = 300_000


def _style(name):
    if name in STYLE:
        return STYLE[name]
    if name.startswith("mala"):
        return dict(color="tab:red", marker="D")
    if name.startswith("fsa"):
        return dict(color="tab:orange", marker="v")
    return dict(marker=".")


def _ok(records, **kw):
    out = []
    for r in records:
        if r.get("status") != "ok":
            continue
        if all(r.get(k) == v for k, v in kw.items()):
            out.append(r)
    return out


def _save(fig, path):
    for dpi in (110, 90, 72, 60):
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        if os.path.getsize(path) < MAX_BYTES:
            break
    plt.close(fig)
    return path


def _title_suffix(meta):
    dev = meta.get("device", "?")
    return f"{dev}, torch {meta.get('torch', '?')}, commit {str(meta.get('git_commit', '?'))[:10]}"


def _klabel(x, _pos=None):
    return f"{int(x) // 1024}K" if x >= 1024 else f"{int(x)}"


def _latency_panel(ax, recs, title, xkey="N", scale=1.0, unit="ms"):
    names = []
    for r in recs:
        if r["system"] not in names:
            names.append(r["system"])
    for name in names:
        pts = sorted((r[xkey], r["ms"] * scale) for r in recs if r["system"] == name)
        if not pts:
            continue
        label = next(r["label"] for r in recs if r["system"] == name)
        flagged = any(r.get("flagged") for r in recs if r["system"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label + (" [flagged]" if flagged else ""),
                linewidth=1.3, markersize=4, **_style(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_klabel))
    ax.set_xlabel("sequence length N" if xkey == "N" else xkey)
    ax.set_ylabel(f"latency ({unit}, median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def plot_training(data, out, section, fname, shapes):
    recs = data["records"]
    panels = []
    for shape in shapes:
        for op, opname in OPS:
            r = _ok(recs, section=section, op=op, **shape)
            if r:
                panels.append((r, f"{opname}  Hq={shape['Hq']} Hkv={shape['Hkv']} d={shape['d']}"))
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (r, title) in zip(axes.flat, panels):
        _latency_panel(ax, r, title)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{section}: bf16 causal, batch 1, random inputs ({_title_suffix(data['meta'])})", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out, fname))


def plot_decode(data, out):
    recs = _ok(data["records"], section="decode")
    if not recs:
        return None
    combos = sorted({(r["B"], r["regime"], r["sharpness"]) for r in recs})
    cols = min(2, len(combos))
    rows = (len(combos) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.9 * rows), squeeze=False)
    for ax, (B, regime, sharp) in zip(axes.flat, combos):
        r = [x for x in recs if x["B"] == B and x["regime"] == regime and x["sharpness"] == sharp]
        _latency_panel(ax, r, f"decode, batch {B}, {regime}" + (f" (sharpness {sharp:g})" if sharp else ""),
                       scale=1000.0, unit="µs")
        ax.set_xlabel("KV cache length N")
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"decode: 1 token, Hq=8 Hkv=1 d=128 ({_title_suffix(data['meta'])})", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out, "latency_decode.png"))


def sweep_points(data, N, op):
    """[(system, label, retained_fraction, speedup, flagged)] for the sweep at N."""
    recs = _ok(data["records"], section="sweep", N=N, op=op)
    by_input = {}
    for r in recs:
        by_input.setdefault((r["regime"], r["sharpness"]), []).append(r)
    pts = []
    for key, rs in by_input.items():
        dense = [r["ms"] for r in rs if r["tau"] is None]
        if not dense:
            continue
        best = min(dense)
        mala = [r for r in rs if r["system"].startswith("mala") and r.get("fwd_retained_fraction") is not None]
        rf_key = "bwd_retained_fraction" if op == "bwd" else "fwd_retained_fraction"
        x_input = None
        if mala and mala[0].get(rf_key) is not None:
            x_input = mala[0][rf_key]
        elif any(r.get("rule_retained_fraction") is not None for r in rs):
            x_input = next(r["rule_retained_fraction"] for r in rs if r.get("rule_retained_fraction") is not None)
        for r in rs:
            if r["tau"] is None:
                continue
            x = r.get(rf_key) if r["system"].startswith("mala") else x_input
            if x is None:
                continue
            pts.append((r["system"], r["label"], x, best / r["ms"], bool(r.get("flagged"))))
    return pts


def plot_sweep(data, out):
    recs = _ok(data["records"], section="sweep")
    if not recs:
        return None
    ns = sorted({r["N"] for r in recs})
    ops = [op for op, _ in OPS if any(r["op"] == op for r in recs)]
    panels = [(n, op) for n in ns for op in ops]
    cols = min(len(ops), 3)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, (n, op) in zip(axes.flat, panels):
        pts = sweep_points(data, n, op)
        for name in sorted({p[0] for p in pts}):
            ps = sorted((p[2], p[3]) for p in pts if p[0] == name)
            label = next(p[1] for p in pts if p[0] == name)
            if any(p[4] for p in pts if p[0] == name):
                label += " [flagged]"
            ax.plot([p[0] for p in ps], [p[1] for p in ps], label=label, linewidth=1.3, markersize=5,
                    **_style(name))
        ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _p: f"{100 * x:g}%"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.invert_xaxis()
        ax.set_xlabel("MALA retained fraction of legal tiles (" + ("bwd" if op == "bwd" else "fwd") + ")")
        ax.set_ylabel("speedup over fastest dense")
        ax.set_title(f"{dict(OPS)[op]}, N={n}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if pts:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"synthetic sharpness sweep, Hq=8 Hkv=1 d=128 ({_title_suffix(data['meta'])})", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out, "speedup_sweep.png"))


def plot_dist(data, out):
    recs = _ok(data["records"], section="dist")
    if not recs:
        return None
    ops = [op for op in ("fwd", "bwd", "fwd_bwd", "decode") if any(r["op"] == op for r in recs)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops), 3.9), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        _latency_panel(ax, [r for r in recs if r["op"] == op], f"{op}, TP={recs[0].get('world_size')}")
        ax.set_ylabel("group latency (ms, median of max over ranks)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"tensor parallel: {recs[0].get('heads_q_total', 64)} query / {recs[0].get('heads_kv_total', 8)} KV "
                 f"heads over {recs[0].get('world_size')} GPUs "
                 f"({_title_suffix(data['meta'])})", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out, "latency_dist.png"))


def make_all(data, out):
    os.makedirs(out, exist_ok=True)
    made = [
        plot_training(data, out, "primary", "latency_primary.png", [dict(Hq=8, Hkv=1, d=128)]),
        plot_training(data, out, "secondary", "latency_secondary.png", [dict(Hq=8, Hkv=1, d=64),
                                                                        dict(Hq=8, Hkv=8, d=128)]),
        plot_decode(data, out),
        plot_sweep(data, out),
        plot_dist(data, out),
    ]
    return [os.path.basename(m) for m in made if m]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        d = json.load(f)
    print(make_all(d, sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(sys.argv[1]))))

#!/usr/bin/env python3
"""The study's summary and plots from one run's results (a folder, or the .tgz gpu_run.sh packs).

    python3 lab/train/train_summary.py --res bench/results/train/run1.tgz --corpus lab/train/corpus \\
        --out bench/results/train/summary.json --plots docs/img

summary.json: {"device", "corpus": {...}, "sizes": {NAME: {"dense": {...}, "mala": {...}}}}; each arm:
params (and non_embedding_params), tokens (pre-training + long-context), final_heldout_loss_4k /
_16k (the final model), the same after pre-training (pt_*), fwd_slots_16k, bwd_slots_16k,
fwd_retained_16k, bwd_retained_16k (MALA tau = 1 on the held-out batch, both arms, mean over layers),
per-layer slots, step_ms / attn_fwd_ms / attn_bwd_ms at 16K (and _4k), attn_flops_per_token at 16K
(the paper's accounting: dense for the dense arm, realized slots for MALA), and the fidelity at 16K
(means over sequence x layer x head with 95% bootstrap intervals); the MALA arm also holds
the matched-work study on its states (matched_work, by N).  Plots need matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import configs  # noqa: E402


def load(path):
    with open(path) as f:
        return json.load(f)


def bootstrap_ci(x, reps=2000, seed=0, stat=np.mean):
    """Point estimate and 95% percentile bootstrap interval of stat over the samples x."""
    x = np.asarray(x, dtype=float).ravel()
    rng = np.random.default_rng(seed)
    boots = [stat(x[rng.integers(0, x.size, x.size)]) for _ in range(reps)]
    return [float(stat(x)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]


def layer_means(layers, key):
    return float(np.mean([x[key] for x in layers]))


def arm_summary(res, size, arm):
    pt = load(os.path.join(res, f"train_{size}_{arm}_pt.json"))
    lct_path = os.path.join(res, f"train_{size}_{arm}_lct.json")
    lct = load(lct_path) if os.path.exists(lct_path) else None
    last = (lct or pt)["evals"][-1]
    cfg = pt["config"]
    out = {
        "params": pt["params"], "non_embedding_params": pt["non_embedding_params"],
        "tokens": pt["final"]["tokens"] + (lct["final"]["tokens"] if lct else 0),
        "tokens_pt": pt["final"]["tokens"], "tokens_lct": lct["final"]["tokens"] if lct else 0,
        "steps_pt": pt["final"]["step"], "steps_lct": lct["final"]["step"] if lct else 0,
        "tokens_per_non_embedding_param": (pt["final"]["tokens"] + (lct["final"]["tokens"] if lct else 0))
        / pt["non_embedding_params"],
        "final_heldout_loss_4k": last["len_4096"]["loss"], "final_heldout_loss_16k": last["len_16384"]["loss"],
        "pt_heldout_loss_4k": pt["evals"][-1]["len_4096"]["loss"],
        "pt_heldout_loss_16k": pt["evals"][-1]["len_16384"]["loss"],
    }
    for n, tag in ((16384, "16k"), (4096, "4k")):
        layers = last[f"len_{n}"]["layers"]
        for k in ("fwd_slots", "bwd_slots", "fwd_retained", "bwd_retained"):
            out[f"{k}_{tag}"] = layer_means(layers, k)
        out[f"fwd_slots_{tag}_per_layer"] = [x["fwd_slots"] for x in layers]
        out[f"bwd_slots_{tag}_per_layer"] = [x["bwd_slots"] for x in layers]
    h, d, L = cfg["num_attention_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
    layers16 = last["len_16384"]["layers"]
    out["attn_flops_per_token"] = (
        configs.attention_flops_per_token(16384, h, d, L) if arm == "dense" else
        configs.attention_flops_per_token(16384, h, d, L, [x["fwd_slots"] for x in layers16],
                                          [x["bwd_slots"] for x in layers16]))
    out["attn_flops_per_token_dense_accounting"] = configs.attention_flops_per_token(16384, h, d, L)
    timing_path = os.path.join(res, "timing.json")
    if os.path.exists(timing_path):
        t = load(timing_path)
        for stage, n, tag in (("lct", 16384, ""), ("pt", 4096, "_4k")):
            r = t.get(f"{size}_{arm}_{stage}_{n}")
            if r:
                for k in ("step_ms", "attn_fwd_ms", "attn_bwd_ms"):
                    out[k + tag] = r[k]
    return out, pt, lct


def fidelity_summary(regime, n="16384"):
    """Fig. 2 quantities at n: means (over sequence x layer x head) with 95% bootstrap intervals."""
    seqs = regime["fidelity"][n]
    out = {}
    for k in ("omitted_mean", "omitted_p95", "omitted_max", "o_err", "dq_err", "dk_err", "dv_err", "fwd_retained"):
        out[k] = bootstrap_ci([h for layers in seqs for layer in layers for h in layer[k]])
    return out


def slots_vs_length(regime):
    """{N: [mean fwd slots, mean bwd slots, fwd retained, a = (N + 1) / 2]} over sequences and layers."""
    out = {}
    for n, seqs in regime["lengths"].items():
        layers = [x for s in seqs for x in s["layers"]]
        out[n] = {"fwd_slots": layer_means(layers, "fwd_slots"), "bwd_slots": layer_means(layers, "bwd_slots"),
                  "fwd_retained": layer_means(layers, "fwd_retained"),
                  "bwd_retained": layer_means(layers, "bwd_retained"), "dense_slots": (int(n) + 1) / 2,
                  "fwd_slots_per_layer": [float(np.mean([s["layers"][i]["fwd_slots"] for s in seqs]))
                                          for i in range(len(seqs[0]["layers"]))]}
    return out


def plots(summary, runs, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    colors = {"dense": "tab:blue", "mala": "tab:red"}
    styles = {0: "-", 1: "--", 2: ":"}
    sizes = list(summary["sizes"])
    # Held-out loss against tokens and against attention FLOPs.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for si, size in enumerate(sizes):
        for arm in ("dense", "mala"):
            pt, lct = runs[size][arm]
            evs = pt["evals"] + ([dict(e, step=e["step"] + pt["final"]["step"]) for e in lct["evals"]] if lct else [])
            tok = [e["tokens"] for e in pt["evals"]] + ([pt["final"]["tokens"] + e["tokens"] for e in lct["evals"]]
                                                       if lct else [])
            fl = [e["attn_flops_arm"] for e in pt["evals"]] + (
                [pt["evals"][-1]["attn_flops_arm"] + e["attn_flops_arm"] for e in lct["evals"]] if lct else [])
            loss = [e["len_4096"]["loss"] for e in evs]
            lab = f"{size} {arm}"
            axes[0].plot(np.array(tok[1:]) / 1e6, loss[1:], styles[si % 3], color=colors[arm], label=lab)
            axes[1].plot(np.array(fl[1:]) / 1e15, loss[1:], styles[si % 3], color=colors[arm], label=lab)
    axes[0].set_xlabel("training tokens (M)")
    axes[1].set_xlabel("attention FLOPs, paper's accounting (PFLOP)")
    for ax in axes:
        ax.set_ylabel("held-out loss at 4K (nats)")
        ax.set_ylim(3, 7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training_loss.png"), dpi=110)
    plt.close(fig)
    # Slots per query over training, per layer (held-out batch at the stage's length, MALA tau = 1).
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for si, size in enumerate(sizes):
        ax = axes[0][si]
        for arm in ("dense", "mala"):
            pt, lct = runs[size][arm]
            steps = [e["step"] for e in pt["evals"]]
            dense_slots = (4096 + 1) / 2
            per = np.array([[x["fwd_slots"] / dense_slots for x in e["len_4096"]["layers"]] for e in pt["evals"]])
            for li in range(per.shape[1]):
                ax.plot(steps, per[:, li], styles[li % 3] if li < 3 else "-.", color=colors[arm],
                        label=f"{arm} layer {li}", alpha=0.8)
        ax.set_title(f"{size}: forward slots / dense slots, 4K pre-training")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training_slots.png"), dpi=110)
    plt.close(fig)
    # Slots against length, MALA-trained and dense-trained.
    fig, ax = plt.subplots(figsize=(6, 4))
    for si, size in enumerate(sizes):
        for arm in ("dense", "mala"):
            svl = summary["sizes"][size][arm].get("slots_vs_length")
            if not svl:
                continue
            ns = sorted(svl, key=int)
            ax.plot([int(n) for n in ns], [svl[n]["fwd_retained"] for n in ns], styles[si % 3] + "o",
                    color=colors[arm], label=f"{size} {arm}-trained")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("forward tiles retained at tau = 1")
    ax.set_ylim(0, 1.05)
    ax.axhline(0.15, color="gray", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training_slots_vs_length.png"), dpi=110)
    plt.close(fig)
    # Attention time per step.
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, fw, bw, rest = [], [], [], []
    for size in sizes:
        for arm in ("dense", "mala"):
            s = summary["sizes"][size][arm]
            for tag, n in (("_4k", "4K"), ("", "16K")):
                if "step_ms" + tag in s:
                    labels.append(f"{size}\n{arm} {n}")
                    fw.append(s["attn_fwd_ms" + tag])
                    bw.append(s["attn_bwd_ms" + tag])
                    rest.append(s["step_ms" + tag] - s["attn_fwd_ms" + tag] - s["attn_bwd_ms" + tag])
    x = np.arange(len(labels))
    ax.bar(x, fw, label="attention forward")
    ax.bar(x, bw, bottom=fw, label="attention backward")
    ax.bar(x, rest, bottom=np.array(fw) + np.array(bw), label="rest", color="lightgray")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("ms per step (64K tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training_step_time.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", required=True)
    ap.add_argument("--corpus", required=True, help="the folder with manifest.json and streams.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plots", default="")
    a = ap.parse_args(argv)
    if a.res.endswith(".tgz"):  # a packed results folder, as gpu_run.sh returns it
        import tarfile
        import tempfile

        tmp = tempfile.mkdtemp(prefix="train-res-")
        with tarfile.open(a.res) as t:
            t.extractall(tmp, filter="data")
        a.res = tmp
    manifest = load(os.path.join(a.corpus, "manifest.json"))
    streams = load(os.path.join(a.corpus, "streams.json"))
    sizes = sorted({f.split("_")[1] for f in os.listdir(a.res) if f.startswith("train_") and f.endswith("_pt.json")},
                   key=lambda s: configs.SIZES[s]["hidden"] * configs.SIZES[s]["layers"])
    regime = load(os.path.join(a.res, "regime.json")) if os.path.exists(os.path.join(a.res, "regime.json")) else {}
    speed = load(os.path.join(a.res, "speed.json")) if os.path.exists(os.path.join(a.res, "speed.json")) else {}
    matched = load(os.path.join(a.res, "matched_work.json")) if os.path.exists(
        os.path.join(a.res, "matched_work.json")) else {}
    summary = {"device": None, "corpus": {"files": manifest["counts"], "tokens": {
        "train": streams["train_tokens"], "heldout": streams["heldout_tokens"]},
        "stream_sha256": {"train": streams["train_sha256"], "heldout": streams["heldout_sha256"]},
        "heldout_packages": {k: len(v) for k, v in manifest["heldout_packages"].items()}}, "sizes": {}}
    runs = {}
    for size in sizes:
        summary["sizes"][size] = {}
        runs[size] = {}
        for arm in ("dense", "mala"):
            s, pt, lct = arm_summary(a.res, size, arm)
            summary["device"] = summary["device"] or pt["device"]
            key = f"{size}_{arm}_lct"
            if key in regime:
                s["slots_vs_length"] = slots_vs_length(regime[key])
                s["fidelity_16k"] = fidelity_summary(regime[key])
            sp = speed.get(f"{size}_{arm}_lct_16384")
            if sp:
                s["attention_speed_16k"] = {k: {"fwd_ms": v["fwd_ms"], "bwd_ms": v["bwd_ms"]} for k, v in sp.items()}
            summary["sizes"][size][arm] = s
            runs[size][arm] = (pt, lct)
        for n in ("8192", "16384"):  # the matched-work study runs on the MALA-trained model's states
            m = matched.get(f"{size}_{n}")
            if m:
                summary["sizes"][size]["mala"].setdefault("matched_work", {})[n] = {
                    p: {k: m[p][k] for k in ("slots", "omitted_mean", "omitted_p95", "err_mean", "err_p95")}
                    for p in m if isinstance(m[p], dict) and "slots" in m[p]}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    if a.plots:
        plots(summary, runs, a.plots)
    for size in sizes:
        for arm in ("dense", "mala"):
            s = summary["sizes"][size][arm]
            print(f"{size} {arm}: tokens {s['tokens'] / 1e6:.1f}M, loss 4K {s['final_heldout_loss_4k']:.3f} "
                  f"16K {s['final_heldout_loss_16k']:.3f}, fwd retained 16K {s['fwd_retained_16k']:.3f}, "
                  f"slots {s['fwd_slots_16k']:.0f} / {s['bwd_slots_16k']:.0f}, step {s.get('step_ms', 0):.1f} ms "
                  f"(attn {s.get('attn_fwd_ms', 0):.1f} + {s.get('attn_bwd_ms', 0):.1f})")


if __name__ == "__main__":
    sys.exit(main())

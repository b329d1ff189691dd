#!/usr/bin/env python3
"""The study's summary and plots from its runs' results (folders, or the .tgz files gpu_run.sh packs).

    python3 lab/train/train_summary.py --res bench/results/train/run1.tgz --res bench/results/train/run2.tgz \\
        --corpus lab/train/corpus --out bench/results/train/summary.json --plots docs/img

Each --res is one run; each seed of an arm of a size is taken from the last --res that trained it, so
a later run may add an arm (the mala0 control) or seeds to a size.  summary.json: {"device", "corpus": {...}, "sizes": {NAME: {"dense": {...}, "mala": {...}}},
"paired": {NAME: {...}}}.  Each arm: params (and non_embedding_params), tokens (pre-training +
long-context), final_heldout_loss_4k / _16k (the final model), the same after pre-training (pt_*),
fwd_slots_16k, bwd_slots_16k, fwd_retained_16k, bwd_retained_16k (MALA tau = 1 on the held-out batch,
both arms, mean over layers), per-layer slots, step_ms / attn_fwd_ms / attn_bwd_ms at 16K (and _4k),
attn_flops_per_token at 16K (the paper's accounting: dense for the dense arm, realized slots for
MALA), and the fidelity at 16K (means over sequence x layer x head with 95% bootstrap intervals), and where
pre-training probed its gradient (train.py --grad-probe-every) grad_probes_pt, per probe step and
attention the attention's own gradient error, its bias and its distance from cuDNN's; the
MALA arm also holds the matched-work study on its states (matched_work, by N).  With several seeds,
an arm's numbers are means over its seeds, "seeds" lists them, "per_seed" holds each seed's own
summary and "ci95" the 95% t-intervals of the mean over seeds; "paired" holds, per loss, the
MALA-minus-dense difference of the two arms trained from the same seed (same initial weights and
data order): mean, 95% t-interval, and the same relative to dense; "paired_pooled" the relative
differences over every size's pairs (t-interval, sign test); "paired_control", where a mala0 or dense_ea arm
ran, the same pairing of mala0 with dense, of mala with mala0, of dense_ea with dense and of mala0 and mala
with dense_ea; "exact_arms", where two or more exact arms ran, their within-seed spread and MALA against
their mean (exact_arms()); "gap_over_training", per size and pair of arms, the same seed's relative
held-out loss difference at 4K at every pre-training eval (gap_over_training()).  Timing, speed, the fidelity and
the matched-work study use the first seed.  Plots need matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import configs  # noqa: E402


# mala0: MALA's kernels at tau = 0, the control arm; dense_ea: SDPA's memory-efficient kernel, a second
# exact attention (the noise floor of two dense runs of one seed)
ARMS = ("dense", "mala", "mala0", "dense_ea")


def load(path):
    with open(path) as f:
        return json.load(f)


def bootstrap_ci(x, reps=2000, seed=0, stat=np.mean):
    """Point estimate and 95% percentile bootstrap interval of stat over the samples x."""
    x = np.asarray(x, dtype=float).ravel()
    rng = np.random.default_rng(seed)
    boots = [stat(x[rng.integers(0, x.size, x.size)]) for _ in range(reps)]
    return [float(stat(x)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]


# Two-sided 95% quantiles of Student's t by degrees of freedom (intervals over a handful of seeds).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086}


def t_interval(x):
    """[mean, low, high]: the 95% t-interval of the mean of the samples x (None without two)."""
    x = np.asarray(x, dtype=float)
    if x.size < 2:
        return None
    m, se = float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size))
    t = T975.get(x.size - 1, 1.96)
    return [m, m - t * se, m + t * se]


def run_tag(size, arm, stage, seed):
    """train.py's run_tag (that module needs torch): _s<seed> for any seed but the study's default."""
    return f"{size}_{arm}_{stage}" + ("" if seed == configs.SEED else f"_s{seed}")


def size_arm(name):
    """(size, arm) of a pre-training run's file, train_<size>_<arm>_pt[_s<seed>].json (an arm's name
    may hold an underscore, a size's does not); None for any other file."""
    if not (name.startswith("train_") and name.endswith(".json")):
        return None
    size, _, rest = name[len("train_"):-len(".json")].partition("_")
    arm, sep, seed = rest.rpartition("_pt")
    if not sep or arm not in ARMS or (seed and not (seed.startswith("_s") and seed[2:].isdigit())):
        return None
    return size, arm


def seeds_of(res, size, arm):
    """The seeds of the pre-training runs of size / arm in a results folder, the default seed first."""
    out = []
    for f in os.listdir(res):
        head = f"train_{size}_{arm}_pt"
        if f.startswith(head) and f.endswith(".json"):
            rest = f[len(head):-len(".json")]
            if rest == "":
                out.append(configs.SEED)
            elif rest.startswith("_s") and rest[2:].isdigit():
                out.append(int(rest[2:]))
    return sorted(out, key=lambda s: (s != configs.SEED, s))


def trained_runs(folders):
    """(size, arm) -> {seed: the last of the results folders that pre-trained that seed of that arm}."""
    where = {}
    for res in folders:
        for sa in {sa for sa in map(size_arm, os.listdir(res)) if sa}:
            for seed in seeds_of(res, *sa):
                where.setdefault(sa, {})[seed] = res
    return where


def layer_means(layers, key):
    return float(np.mean([x[key] for x in layers]))


def arm_summary(res, size, arm, seed=configs.SEED):
    pt = load(os.path.join(res, f"train_{run_tag(size, arm, 'pt', seed)}.json"))
    lct_path = os.path.join(res, f"train_{run_tag(size, arm, 'lct', seed)}.json")
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
    if pt.get("grad_probes"):  # train.py --grad-probe-every: the attention's own gradient error over pre-training
        out["grad_probes_pt"] = [{"step": p["step"], **{lab: {k: v[k] for k in ("attn_rel_err", "attn_bias", "rel_to_sdpa")
                                                               if k in v} for lab, v in p["attention"].items()}}
                                 for p in pt["grad_probes"]]
    for n, tag in ((16384, "16k"), (4096, "4k")):
        layers = last[f"len_{n}"]["layers"]
        for k in ("fwd_slots", "bwd_slots", "fwd_retained", "bwd_retained"):
            out[f"{k}_{tag}"] = layer_means(layers, k)
        out[f"fwd_slots_{tag}_per_layer"] = [x["fwd_slots"] for x in layers]
        out[f"bwd_slots_{tag}_per_layer"] = [x["bwd_slots"] for x in layers]
    h, d, L = cfg["num_attention_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
    layers16 = last["len_16384"]["layers"]
    out["attn_flops_per_token"] = (
        # The arm's own training tau: dense accounting where it skipped nothing (dense, mala0).
        configs.attention_flops_per_token(16384, h, d, L) if (lct or pt)["tau"] == 0 else
        configs.attention_flops_per_token(16384, h, d, L, [x["fwd_slots"] for x in layers16],
                                          [x["bwd_slots"] for x in layers16]))
    out["attn_flops_per_token_dense_accounting"] = configs.attention_flops_per_token(16384, h, d, L)
    timing_path = os.path.join(res, "timing.json")
    if os.path.exists(timing_path):
        t = load(timing_path)
        for stage, n, tag in (("lct", 16384, ""), ("pt", 4096, "_4k")):
            key = f"{run_tag(size, arm, stage, seed)}_{n}"
            r = t.get(key) or t.get(key + "_compiled")  # a run with COMPILE_LOSS=1 times its compiled loss
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


LOSSES = ("final_heldout_loss_4k", "final_heldout_loss_16k", "pt_heldout_loss_4k", "pt_heldout_loss_16k")
SPREAD = LOSSES + ("fwd_retained_16k", "bwd_retained_16k", "fwd_slots_16k", "bwd_slots_16k", "fwd_retained_4k",
                   "attn_flops_per_token")


def over_seeds(per_seed):
    """One arm's summary over its seeds: scalars and lists averaged, other entries from the first
    seed; with two or more seeds, "ci95" of the main quantities and "per_seed"."""
    seeds = list(per_seed)
    first = per_seed[seeds[0]]
    out = {}
    for k, v in first.items():
        vals = [per_seed[s].get(k) for s in seeds]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = float(np.mean(vals)) if len(seeds) > 1 else v
        elif all(isinstance(x, list) and x and all(isinstance(y, (int, float)) for y in x) for x in vals) \
                and len({len(x) for x in vals}) == 1:
            out[k] = [float(y) for y in np.mean(np.array(vals, dtype=float), axis=0)]
        else:
            out[k] = v
    out["seeds"] = seeds
    if len(seeds) > 1:
        out["ci95"] = {k: t_interval([per_seed[s][k] for s in seeds]) for k in SPREAD if k in first}
        out["per_seed"] = {str(s): per_seed[s] for s in seeds}
    return out


def pooled(paired_by_size):
    """Per loss, MALA's relative difference from dense over every (size, seed) pair: the 95%
    t-interval of its mean and how many pairs are positive (under no difference, each sign is a coin
    flip: the one-sided sign-test p-value is P(at least that many of n))."""
    out = {}
    for k in LOSSES:
        r = [x for p in paired_by_size.values() for x in p[k]["relative"]]
        n, pos = len(r), sum(x > 0 for x in r)
        p_sign = sum(math.comb(n, j) for j in range(pos, n + 1)) / 2 ** n if n else None
        out[k] = {"pairs": n, "positive": pos, "relative_mean_ci95": t_interval(r), "sign_test_p": p_sign,
                  "sizes": list(paired_by_size)}
    return out


def exact_arms(per_arm):
    """Where two or more exact arms (dense, dense_ea, mala0: no tile skipped) trained the same seeds:
    per loss, the seeds' exact runs, their within-seed spread (pooled standard deviation of one run,
    relative to the seed's mean), MALA relative to its seed's exact mean (mean and 95% t-interval),
    and how many (MALA-kernel run, SDPA run) pairs of one seed put the MALA-kernel run (mala or mala0)
    above the SDPA one (dense or dense_ea)."""
    exact = [a for a in ("dense", "dense_ea", "mala0") if a in per_arm]
    if len(exact) < 2:
        return None
    seeds = [s for s in per_arm[exact[0]] if all(s in per_arm[a] for a in exact)]
    out = {"arms": exact, "seeds": seeds}
    for k in LOSSES:
        runs = {str(s): {a: per_arm[a][s][k] for a in exact} for s in seeds}
        mean = {s: float(np.mean(list(runs[str(s)].values()))) for s in seeds}
        dev = [(v - mean[s]) / mean[s] for s in seeds for v in runs[str(s)].values()]
        dof = len(seeds) * (len(exact) - 1)
        e = {"runs": runs, "run_sd_relative": float(math.sqrt(sum(x * x for x in dev) / dof))}
        if "mala" in per_arm and all(s in per_arm["mala"] for s in seeds):
            r = [(per_arm["mala"][s][k] - mean[s]) / mean[s] for s in seeds]
            e["mala_minus_exact_mean_relative"] = [float(x) for x in r]
            e["mala_minus_exact_mean_relative_ci95"] = t_interval(r)
        mk = [a for a in ("mala", "mala0") if a in per_arm]
        sd = [a for a in ("dense", "dense_ea") if a in per_arm]
        if mk and sd:
            cmp = [per_arm[m][s][k] > per_arm[d][s][k] for s in seeds for m in mk for d in sd
                   if s in per_arm[m] and s in per_arm[d]]
            e["mala_kernels_above_sdpa"] = [int(sum(cmp)), len(cmp)]
        out[k] = e
    return out


def paired(dense_seeds, mala_seeds):
    """Per loss: MALA minus dense of the two arms trained from the same seed, over the seeds both
    arms have: mean and 95% t-interval, absolute and relative to dense."""
    common = [s for s in dense_seeds if s in mala_seeds]
    out = {"seeds": common}
    for k in LOSSES:
        d = np.array([mala_seeds[s][k] - dense_seeds[s][k] for s in common])
        r = np.array([(mala_seeds[s][k] - dense_seeds[s][k]) / dense_seeds[s][k] for s in common])
        out[k] = {"diff": [float(x) for x in d], "mean": float(d.mean()), "ci95": t_interval(d),
                  "relative": [float(x) for x in r], "relative_mean": float(r.mean()), "relative_ci95": t_interval(r)}
    return out


GAP_PAIRS = (("dense", "mala"), ("dense", "mala0"), ("dense", "dense_ea"))


def gap_over_training(runs_size):
    """Per pair of arms (b - a, GAP_PAIRS) of one size: the held-out loss at 4K of b relative to a at
    every pre-training eval both runs of a seed have, per seed, with the mean and 95% t-interval over
    seeds at each step: where in training a final gap opens."""
    out = {}
    by_seed = {arm: {pt["seed"]: pt for pt, _ in runs_size[arm]} for arm in runs_size}
    for a, b in GAP_PAIRS:
        if a not in by_seed or b not in by_seed:
            continue
        seeds = [sd for sd in by_seed[a] if sd in by_seed[b]]
        if not seeds:
            continue
        ev = {sd: ({e["step"]: e["len_4096"]["loss"] for e in by_seed[a][sd]["evals"]},
                   {e["step"]: e["len_4096"]["loss"] for e in by_seed[b][sd]["evals"]}) for sd in seeds}
        steps = sorted(set.intersection(*(set(ea) & set(eb) for ea, eb in ev.values())))
        rel = [[(ev[sd][1][st] - ev[sd][0][st]) / ev[sd][0][st] for sd in seeds] for st in steps]
        out[f"{b}_minus_{a}"] = {"seeds": seeds, "steps": steps, "relative": rel,
                                 "mean": [float(np.mean(r)) for r in rel], "ci95": [t_interval(r) for r in rel]}
    return out


def probed_seeds(arm_summary_over_seeds):
    """(seed, grad_probes_pt) for each seed of an arm whose pre-training probed its gradient."""
    a = arm_summary_over_seeds
    per = a.get("per_seed") or {str(a["seeds"][0]): a}
    return [(int(sd), x["grad_probes_pt"]) for sd, x in per.items() if x.get("grad_probes_pt")]


def plots(summary, runs, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    colors = {"dense": "tab:blue", "mala": "tab:red", "mala0": "tab:green", "dense_ea": "tab:gray"}
    styles = {0: "-", 1: "--", 2: ":"}
    sizes = list(summary["sizes"])
    # Held-out loss against tokens and against attention FLOPs.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for si, size in enumerate(sizes):
        for arm, (pt, lct), seed_i in ((arm, r, i) for arm in runs[size]
                                      for i, r in enumerate(runs[size][arm])):
            evs = pt["evals"] + ([dict(e, step=e["step"] + pt["final"]["step"]) for e in lct["evals"]] if lct else [])
            tok = [e["tokens"] for e in pt["evals"]] + ([pt["final"]["tokens"] + e["tokens"] for e in lct["evals"]]
                                                       if lct else [])
            fl = [e["attn_flops_arm"] for e in pt["evals"]] + (
                [pt["evals"][-1]["attn_flops_arm"] + e["attn_flops_arm"] for e in lct["evals"]] if lct else [])
            loss = [e["len_4096"]["loss"] for e in evs]
            lab = f"{size} {arm}" if seed_i == 0 else None
            alpha = 1.0 if seed_i == 0 else 0.45
            axes[0].plot(np.array(tok[1:]) / 1e6, loss[1:], styles[si % 3], color=colors[arm], label=lab, alpha=alpha)
            axes[1].plot(np.array(fl[1:]) / 1e15, loss[1:], styles[si % 3], color=colors[arm], label=lab, alpha=alpha)
    axes[0].set_xlabel("training tokens (M)")
    axes[1].set_xlabel("attention FLOPs, paper's accounting (PFLOP)")
    for ax in axes:
        ax.set_ylabel("held-out loss at 4K (nats)")
        ax.set_ylim(2.5, 7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training_loss.png"), dpi=110)
    plt.close(fig)
    # Forward tiles kept over training, per layer (held-out batch at 4K, MALA tau = 1): the mean over
    # seeds, with the seeds' range shaded.
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for si, size in enumerate(sizes):
        ax = axes[0][si]
        for arm in ("dense", "mala"):
            if arm not in runs[size]:
                continue
            runs_arm = [pt for pt, _ in runs[size][arm]]
            n_ev = min(len(pt["evals"]) for pt in runs_arm)
            steps = [e["step"] for e in runs_arm[0]["evals"][:n_ev]]
            per = np.array([[[x["fwd_retained"] for x in e["len_4096"]["layers"]] for e in pt["evals"][:n_ev]]
                            for pt in runs_arm])  # [seed, eval, layer]
            for li in range(per.shape[2]):
                ax.plot(steps, per[:, :, li].mean(axis=0), styles[li % 3] if li < 3 else "-.", color=colors[arm],
                        label=f"{arm} layer {li}", alpha=0.9)
                if per.shape[0] > 1:
                    ax.fill_between(steps, per[:, :, li].min(axis=0), per[:, :, li].max(axis=0), color=colors[arm],
                                    alpha=0.08)
        n_seeds = len(runs[size].get("mala", []))
        ax.set_title(f"{size}: forward tiles kept, 4K pre-training ({n_seeds} seed{'s' * (n_seeds > 1)})")
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
        for arm in summary["sizes"][size]:
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
    # The paired gap over pre-training: each pair of arms' relative held-out loss difference at 4K,
    # the mean over seeds with its 95% t-interval shaded.
    gaps = summary.get("gap_over_training", {})
    if gaps:
        fig, axes = plt.subplots(1, len(gaps), figsize=(5.5 * len(gaps), 4), squeeze=False)
        for ax, (size, pairs) in zip(axes[0], gaps.items()):
            for name, g in pairs.items():
                arm = name.split("_minus_")[0]
                steps, mean = np.array(g["steps"]), 100 * np.array(g["mean"])
                ax.plot(steps, mean, color=colors[arm], label=f"{arm} - dense ({len(g['seeds'])} seed{'s' * (len(g['seeds']) > 1)})")
                if len(g["seeds"]) > 1:
                    lo = [100 * c[1] for c in g["ci95"]]
                    hi = [100 * c[2] for c in g["ci95"]]
                    ax.fill_between(steps, lo, hi, color=colors[arm], alpha=0.12)
            ax.axhline(0, color="black", lw=0.8)
            ax.set_ylim(-15, 15)
            ax.set_title(f"{size}: held-out loss at 4K relative to dense, pre-training")
            ax.set_xlabel("step")
            ax.set_ylabel("% of dense's loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "training_gap.png"), dpi=110)
        plt.close(fig)
    # The gradient probes over pre-training (train.py --grad-probe-every): each attention's own error
    # against fp32 attention, and its component along the gradient, per size, arm and probed seed.
    probed = [(size, arm, seed, probes) for size in sizes for arm in summary["sizes"][size]
              for seed, probes in probed_seeds(summary["sizes"][size][arm])]
    if probed:
        fig, axes = plt.subplots(2, len(probed), figsize=(5.5 * len(probed), 7), squeeze=False)
        for col, (size, arm, seed, probes) in enumerate(probed):
            steps = [p["step"] for p in probes]
            for label in (k for k in probes[0] if k != "step"):
                axes[0][col].plot(steps, [100 * p[label]["attn_rel_err"] for p in probes], "o-", label=label)
                axes[1][col].plot(steps, [100 * p[label]["attn_bias"] for p in probes], "o-", label=label)
            axes[0][col].set_title(f"{size} {arm} seed {seed}: gradient error vs fp32 attention", fontsize=9)
            axes[0][col].set_ylabel("relative error (%)")
            axes[1][col].set_ylabel("component along the gradient (%)")
            axes[1][col].axhline(0, color="black", lw=0.8)
            for ax in axes[:, col]:
                ax.set_xlabel("pre-training step")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "training_grad_probes.png"), dpi=110)
        plt.close(fig)
    # Attention time per step.
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, fw, bw, rest = [], [], [], []
    for size in sizes:
        for arm in summary["sizes"][size]:
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


def unpack(res):
    """A results folder, or a packed one (.tgz) unpacked into a temporary folder."""
    if not res.endswith(".tgz"):
        return res
    import tarfile
    import tempfile

    tmp = tempfile.mkdtemp(prefix="train-res-")
    with tarfile.open(res) as t:
        t.extractall(tmp, filter="data")
    return tmp


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", required=True, action="append", help="a run's results (repeatable)")
    ap.add_argument("--corpus", required=True, help="the folder with manifest.json and streams.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plots", default="")
    a = ap.parse_args(argv)
    folders = [unpack(r) for r in a.res]
    manifest = load(os.path.join(a.corpus, "manifest.json"))
    streams = load(os.path.join(a.corpus, "streams.json"))
    where = trained_runs(folders)
    sizes = sorted({s for s, _ in where}, key=lambda s: configs.SIZES[s]["hidden"] * configs.SIZES[s]["layers"])
    summary = {"device": None, "corpus": {"files": manifest["counts"], "tokens": {
        "train": streams["train_tokens"], "heldout": streams["heldout_tokens"]},
        "stream_sha256": {"train": streams["train_sha256"], "heldout": streams["heldout_sha256"]},
        "heldout_packages": {k: len(v) for k, v in manifest["heldout_packages"].items()}}, "sizes": {}, "paired": {}}
    runs = {}
    for size in sizes:
        summary["sizes"][size] = {}
        runs[size] = {}
        per_arm = {}
        for arm in [a for a in ARMS if (size, a) in where]:
            per_seed = {}
            runs[size][arm] = []
            for seed in sorted(where[(size, arm)], key=lambda s: (s != configs.SEED, s)):
                res = where[(size, arm)][seed]
                regime, speed = (load(os.path.join(res, f)) if os.path.exists(os.path.join(res, f)) else {}
                                 for f in ("regime.json", "speed.json"))
                s, pt, lct = arm_summary(res, size, arm, seed)
                summary["device"] = summary["device"] or pt["device"]
                key = run_tag(size, arm, "lct", seed)
                if key in regime:
                    s["slots_vs_length"] = slots_vs_length(regime[key])
                    s["fidelity_16k"] = fidelity_summary(regime[key])
                sp = speed.get(f"{key}_16384")
                if sp:
                    s["attention_speed_16k"] = {k: ({"fwd_ms": v["fwd_ms"], "bwd_ms": v["bwd_ms"]} if "fwd_ms" in v else v)
                                                for k, v in sp.items()}
                per_seed[seed] = s
                runs[size][arm].append((pt, lct))
            per_arm[arm] = per_seed
            summary["sizes"][size][arm] = over_seeds(per_seed)
            if arm != "mala":
                continue
            first = where[(size, arm)][next(iter(per_seed))]
            path = os.path.join(first, "matched_work.json")
            matched = load(path) if os.path.exists(path) else {}
            for n in ("8192", "16384"):  # the matched-work study runs on the MALA-trained model's states
                m = matched.get(f"{size}_{n}")
                if m:
                    summary["sizes"][size]["mala"].setdefault("matched_work", {})[n] = {
                        p: {k: m[p][k] for k in ("slots", "omitted_mean", "omitted_p95", "err_mean", "err_p95")}
                        for p in m if isinstance(m[p], dict) and "slots" in m[p]}
        if "dense" in per_arm and "mala" in per_arm:
            summary["paired"][size] = paired(per_arm["dense"], per_arm["mala"])
        controls = {f"{b}_minus_{a}": paired(per_arm[a], per_arm[b])
                    for a, b in (("dense", "mala0"), ("mala0", "mala"), ("dense", "dense_ea"), ("dense_ea", "mala0"),
                                 ("dense_ea", "mala"))
                    if a in per_arm and b in per_arm}
        if controls:  # the control (MALA's kernels at tau = 0) and the noise floor (a second exact kernel)
            summary.setdefault("paired_control", {})[size] = controls
        gaps = gap_over_training(runs[size])
        if gaps:
            summary.setdefault("gap_over_training", {})[size] = gaps
        ex = exact_arms(per_arm)
        if ex:
            summary.setdefault("exact_arms", {})[size] = ex
    summary["paired_pooled"] = pooled(summary["paired"])
    for res in folders:  # the gradient's fidelity (analyze.py grads), by run tag and length
        if os.path.exists(os.path.join(res, "grads.json")):
            summary.setdefault("grads", {}).update(load(os.path.join(res, "grads.json")))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    if a.plots:
        plots(summary, runs, a.plots)
    for size in sizes:
        for arm in summary["sizes"][size]:
            s = summary["sizes"][size][arm]
            print(f"{size} {arm} (seeds {s['seeds']}): tokens {s['tokens'] / 1e6:.1f}M, loss 4K {s['final_heldout_loss_4k']:.3f} "
                  f"16K {s['final_heldout_loss_16k']:.3f}, fwd retained 16K {s['fwd_retained_16k']:.3f}, "
                  f"slots {s['fwd_slots_16k']:.0f} / {s['bwd_slots_16k']:.0f}, step {s.get('step_ms', 0):.1f} ms "
                  f"(attn {s.get('attn_fwd_ms', 0):.1f} + {s.get('attn_bwd_ms', 0):.1f})")
        pairs = {"mala_minus_dense": summary["paired"].get(size), **summary.get("paired_control", {}).get(size, {})}
        for name, p in ((n, p) for n, p in pairs.items() if p):
            for k in ("final_heldout_loss_4k", "final_heldout_loss_16k"):
                ci = p[k]["relative_ci95"]
                print(f"{size} paired {k}: {name} {p[k]['mean']:+.4f} nats, {100 * p[k]['relative_mean']:+.2f}%"
                      + (f" (95% CI {100 * ci[1]:+.2f}% .. {100 * ci[2]:+.2f}%)" if ci else ""))
        ex = summary.get("exact_arms", {}).get(size)
        for k in ("final_heldout_loss_4k", "final_heldout_loss_16k") if ex else ():
            e = ex[k]
            ci = e.get("mala_minus_exact_mean_relative_ci95")
            print(f"{size} exact arms {ex['arms']} {k}: one run's sd {100 * e['run_sd_relative']:.2f}%"
                  + (f"; mala - exact mean {100 * ci[0]:+.2f}% ({100 * ci[1]:+.2f}% .. {100 * ci[2]:+.2f}%)" if ci else "")
                  + (f"; MALA-kernel runs above SDPA runs {e['mala_kernels_above_sdpa'][0]} of "
                     f"{e['mala_kernels_above_sdpa'][1]}" if "mala_kernels_above_sdpa" in e else ""))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""bench/results/real/evaluation.json (issue #31's summary) from the model-in-the-loop runs' files,
and, when matplotlib is installed, the training curves (evaluation_training.png).

    python3 lab/real/evaluation_report.py --dir bench/results/real

Reads from --dir: qwen_eval_ppl.json (qwen_eval.py), qwen_niah.json (qwen_niah.py), qwen_e2e.json
(qwen_e2e.py), qwen_train_dense.json and qwen_train_mala.json (qwen_train.py); a missing file leaves
its key out.  Keys: "perplexity" (per length: dense, mala_tau<t>, their relative differences with
95% intervals, slots per query), "niah" (per length: dense, mala_tau1 and trials, accuracies in
percent pooled over the variants, plus each variant's accuracy, interval and disagreements),
"niah_identical_answers" (per configuration: trials whose answer text equals dense's),
"end_to_end" (prefill ms per length and decode tokens/s per batch, with slots), "training"
(dense_final_loss, mala_final_loss, steps, step times, slots, FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def load(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def perplexity(d):
    return d["perplexity"]


def niah(d):
    out = {}
    for n, e in d["niah"].items():
        out[n] = dict(e)
    agree = {}
    for key, rows in d["raw"].items():
        dense = rows["dense"]["outputs"]
        for name, r in rows.items():
            if name in ("dense", "trials"):
                continue
            same = sum(a == b for a, b in zip(dense, r["outputs"]))
            agree.setdefault(name, [0, 0])
            agree[name][0] += same
            agree[name][1] += len(dense)
    return out, {k: {"same": v[0], "trials": v[1]} for k, v in agree.items()}


def end_to_end(d):
    pre = {}
    for n, r in d.get("prefill", {}).items():
        pre[n] = {"ms": r["ms"], "slots_per_query": r["slots_per_query"],
                  "dense_slots_per_query": r["dense_slots_per_query"], "text": r["package"]}
    dec = {}
    for b, r in d.get("decode", {}).items():
        row = {"context": r["context"], "steps": r["steps"], "cuda_graph": r["graphs"]}
        ref = r.get("mala_tau0", {}).get("tokens")
        for name, v in r.items():
            if not isinstance(v, dict) or "ms_per_step" not in v:
                continue
            e = {"ms_per_step": v["ms_per_step"], "tokens_per_s": v["tokens_per_s"],
                 "slots_per_query": v["slots_per_query"], "retained": v["retained"]}
            if ref is not None:
                same = [sum(x == y for x, y in zip(a, c)) for a, c in zip(ref, v["tokens"])]
                e["tokens_equal_to_mala_tau0"] = sum(same) / sum(len(a) for a in ref)
            row[name] = e
        dec[b] = row
    return {"device": d.get("device"), "prefill": pre, "decode": dec}


def training(dense, mala):
    out = {}
    for name, d in (("dense", dense), ("mala", mala)):
        if d is None:
            continue
        out[f"{name}_final_loss"] = d["final"]["held_out_loss"]
        out[f"{name}_held_out"] = [[e["step"], e["held_out_loss"]] for e in d["evals"]]
        out[f"{name}_median_step_seconds"] = d.get("median_step_seconds")
        out["steps"] = d.get("completed_steps")
        out["text"] = d.get("text")
        out["device"] = d.get("device")
        rows = [r for r in d["steps"] if "fwd_slots_per_query" in r]
        if rows:
            out["mala_fwd_slots_per_query"] = statistics.fmean(r["fwd_slots_per_query"] for r in rows)
            out["mala_bwd_slots_per_query"] = statistics.fmean(r["bwd_slots_per_query"] for r in rows)
            out["mala_attention_flops_per_token"] = statistics.fmean(r["attention_flops_per_token"] for r in rows)
            out["dense_attention_flops_per_token"] = rows[0]["dense_attention_flops_per_token"]
    if dense is not None and mala is not None:
        out["final_loss_rel_diff"] = out["mala_final_loss"] / out["dense_final_loss"] - 1
        a = [r["loss"] for r in dense["steps"]]
        b = [r["loss"] for r in mala["steps"]]
        out["train_loss_mean_abs_rel_diff"] = statistics.fmean(abs(y / x - 1) for x, y in zip(a, b))
    return out


def plot(dense, mala, path):
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, d, style in (("dense (SDPA)", dense, "-"), ("MALA tau = 1", mala, "--")):
        s = d["steps"]
        ax[0].plot([r["step"] for r in s], [r["loss"] for r in s], style, lw=1, label=name)
        e = d["evals"]
        ax[1].plot([r["step"] for r in e], [r["held_out_loss"] for r in e], style, marker="o", ms=3, label=name)
    ax[0].set(xlabel="step", ylabel="training loss (nats/token)", title="training loss, one 16K sequence per step")
    ax[1].set(xlabel="step", ylabel="held-out loss (nats/token)", title="held-out loss (http, xml)")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="bench/results/real")
    ap.add_argument("--out", default=None, help="default DIR/evaluation.json")
    args = ap.parse_args()
    j = lambda name: load(os.path.join(args.dir, name))  # noqa: E731
    ppl, nh, e2e, td, tm = (j("qwen_eval_ppl.json"), j("qwen_niah.json"), j("qwen_e2e.json"),
                           j("qwen_train_dense.json"), j("qwen_train_mala.json"))
    first = next((d for d in (ppl, nh, e2e, td, tm) if d), None)
    if first is None:
        raise SystemExit(f"evaluation_report: no result file in {args.dir}")
    doc = {"model": "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, bf16)", "device": first.get("device"),
           "sources": {k: v for k, v in (("perplexity", "qwen_eval_ppl.json"), ("niah", "qwen_niah.json"),
                                         ("end_to_end", "qwen_e2e.json"),
                                         ("training", "qwen_train_dense.json, qwen_train_mala.json"))}}
    if ppl:
        doc["perplexity"] = perplexity(ppl)
    if nh:
        doc["niah"], doc["niah_identical_answers"] = niah(nh)
    if e2e:
        doc["end_to_end"] = end_to_end(e2e)
    if td or tm:
        doc["training"] = training(td, tm)
    with open(args.out or os.path.join(args.dir, "evaluation.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if td and tm and plot(td, tm, os.path.join(args.dir, "evaluation_training.png")):
        print("evaluation_report: wrote the training plot")
    print(f"evaluation_report: keys {', '.join(k for k in doc if k not in ('model', 'device', 'sources'))}")


if __name__ == "__main__":
    main()

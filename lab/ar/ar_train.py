"""Train and evaluate one cell of the associative-recall study (issue #65), or collect cells.

  python3 lab/ar/ar_train.py train --seqlen 8192 --d-model 512 --method mala --seeds 0 1 2 \
      --steps 300 --batch 8 [--time-cap-s 400] --out bench/results/ar/cells/8192_512_mala.json
  python3 lab/ar/ar_train.py collect --cells bench/results/ar/cells --out bench/results/ar/ar.json \
      [--timing DIR]   (step_ms from cells timed alone; the training cells' own become step_ms_concurrent)

train: for each seed, a fresh model (the seed fixes its init, the same for the parameters every
method shares, and the order of the training pool; the pool and the test set are the same for
every method and seed), AdamW with a linear warm-up and cosine decay over --steps steps, then
accuracy over every query of the fixed test set.  Training is step-matched: every method takes the
same --steps optimizer steps on the same batches, whatever its speed.  --time-cap-s is only a
safety net: a seed that reaches it stops there, and its cell says so (hit_time_cap, steps_done);
such a cell is not step-matched, and collect lists it under "stopped_early".  The cell it writes:
  seqlen, d_model, method, accuracy (pooled over seeds), ci95 ([lo, hi], a bootstrap over seeds
  and, within each, over test sequences: the queries of one sequence are not independent), seeds,
  mean_slots (mean forward post-score key slots per query row on the test set, over layers, heads
  and rows, averaged over seeds), step_ms (median training step, first seed, after --skip-steps),
  steps (planned), steps_done (per seed), hit_time_cap (any seed),
plus per-seed details and the setup.  A method that cannot run here (nsa without fla-core or CUDA)
writes a cell with accuracy null and its reason under "skipped".
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ar_data  # noqa: E402
import ar_methods  # noqa: E402
from ar_model import ARModel, loss_fn  # noqa: E402


def bootstrap_ci95(correct_per_seed, n_q: int, reps: int = 2000, seed: int = 0):
    """correct_per_seed: list (one per seed) of int arrays [n_test], correct queries per test
    sequence.  Resamples seeds, then sequences within each drawn seed; percentile interval."""
    rng = np.random.default_rng(seed)
    arrs = [np.asarray(c, dtype=np.float64) for c in correct_per_seed]
    S = len(arrs)
    out = np.empty(reps)
    for r in range(reps):
        tot = 0.0
        for s in rng.integers(0, S, size=S):
            a = arrs[s]
            tot += a[rng.integers(0, len(a), size=len(a))].mean()
        out[r] = tot / S / n_q
    lo, hi = np.percentile(out, [2.5, 97.5])
    return [float(lo), float(hi)]


def lr_at(step, steps, lr, warmup):
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at step `steps`: a function of the
    step alone, so that every method follows the same schedule."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _autocast(dev):
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)


def evaluate(model, tokens, labels, batch, dev):
    """(correct queries per test sequence [n_test], mean forward slots per query row)."""
    model.eval()
    correct, slots = [], []
    with torch.no_grad():
        for i in range(0, len(tokens), batch):
            t = torch.from_numpy(tokens[i:i + batch]).to(dev)
            lab = torch.from_numpy(labels[i:i + batch]).to(dev)
            where = lab != ar_data.IGNORE
            with _autocast(dev):
                logits, _ = model(t, where)
            hit = (logits.argmax(-1) == lab[where]).long()
            per_seq = torch.zeros(len(t), dtype=torch.long, device=dev)
            per_seq.index_add_(0, where.nonzero()[:, 0], hit)
            correct.append(per_seq.cpu().numpy())
            slots.append(model.mean_slots() * len(t))
    model.train()
    return np.concatenate(correct), sum(slots) / len(tokens)


def train_seed(args, cfg, mcfg, seed, test, dev, log):
    torch.manual_seed(seed)
    model = ARModel(cfg.vocab, args.d_model, args.method, n_layers=args.layers, head_dim=args.head_dim, mcfg=mcfg,
                    seed=seed, conv=args.conv).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    stream = ar_data.TrainStream(cfg, args.n_train, args.batch, seed)
    step_s, train_slots, bwd_slots, losses = [], [], [], []
    t_start = time.perf_counter()
    hit_cap = False
    for step in range(args.steps):
        if args.time_cap_s and time.perf_counter() - t_start >= args.time_cap_s:
            hit_cap = True
            log(f"seed {seed} hit the time cap ({args.time_cap_s:.0f} s) after {step} of {args.steps} steps")
            break
        tok, lab = stream.next()
        tok, lab = torch.from_numpy(tok).to(dev), torch.from_numpy(lab).to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        _sync(dev)
        t0 = time.perf_counter()
        where = lab != ar_data.IGNORE
        with _autocast(dev):
            logits, aux = model(tok, where)
        loss = loss_fn(logits, lab[where])
        opt.zero_grad(set_to_none=True)
        (loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync(dev)
        step_s.append(time.perf_counter() - t0)
        train_slots.append(model.mean_slots())
        st = [a.last_stats for a in model.attentions() if a.last_stats is not None]
        if st and st[0].mean_bwd_slots is not None:
            bwd_slots.append(sum(s.mean_bwd_slots for s in st) / len(st))
        losses.append(float(loss.detach()))
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            log(f"seed {seed} step {step} loss {losses[-1]:.4f} slots {train_slots[-1]:.1f} "
                f"step_ms {1e3 * step_s[-1]:.1f}")
    steps_done = len(step_s)
    correct, slots = evaluate(model, test[0], test[1], args.eval_batch, dev)
    timed = step_s[args.skip_steps:] or step_s
    return {
        "seed": seed, "steps_done": steps_done, "hit_time_cap": hit_cap, "train_wall_s": time.perf_counter() - t_start,
        "epochs": steps_done * args.batch / args.n_train,
        "final_loss": float(np.mean(losses[-10:])) if losses else None,
        "accuracy": float(correct.sum() / (len(correct) * cfg.n_q)),
        "correct_per_sequence": correct.tolist(), "mean_slots": float(slots),
        "train_mean_slots": float(np.mean(train_slots)) if train_slots else None,
        "train_mean_bwd_slots": float(np.mean(bwd_slots)) if bwd_slots else None,
        "step_ms": 1e3 * statistics.median(timed) if timed else None,
        "train_s": float(sum(step_s)),
    }


def run_train(args, log=print):
    cfg = ar_data.ARConfig(seqlen=args.seqlen, n_kv=args.n_kv, n_q=args.n_q, n_pass=args.n_pass,
                           vocab=args.vocab, power_a=args.power_a)
    cfg.check()
    mcfg = ar_methods.MethodConfig(ceiling=args.ceiling, moba_block=args.moba_block, nsa_block=args.nsa_block,
                                   nsa_window=args.nsa_window)
    dev = torch.device(args.device)
    setup = {"task": cfg.to_dict(), "methods": mcfg.to_dict(), "layers": args.layers, "head_dim": args.head_dim,
             "conv": args.conv,
             "batch": args.batch, "steps": args.steps, "time_cap_s": args.time_cap_s, "lr": args.lr, "wd": args.wd,
             "warmup": args.warmup, "n_train": args.n_train, "n_test": args.n_test,
             "test_seed": ar_data.TEST_SEED, "train_pool_seed": ar_data.TRAIN_POOL_SEED,
             "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
             "torch": torch.__version__}
    cell = {"seqlen": args.seqlen, "d_model": args.d_model, "method": args.method, "accuracy": None,
            "ci95": None, "seeds": list(args.seeds), "mean_slots": None, "step_ms": None, "steps": args.steps,
            "steps_done": None, "hit_time_cap": None, "setup": setup}
    ok, why = ar_methods.available(args.method, dev)
    if not ok:
        cell["skipped"] = why
        log(f"skipped: {why}")
    else:
        test = ar_data.test_set(cfg, args.n_test)
        runs = [train_seed(args, cfg, mcfg, s, test, dev, log) for s in args.seeds]
        cell["accuracy"] = float(np.mean([r["accuracy"] for r in runs]))
        cell["ci95"] = bootstrap_ci95([r["correct_per_sequence"] for r in runs], cfg.n_q)
        cell["mean_slots"] = float(np.mean([r["mean_slots"] for r in runs]))
        cell["step_ms"] = runs[0]["step_ms"]
        cell["steps_done"] = [r["steps_done"] for r in runs]
        cell["hit_time_cap"] = any(r["hit_time_cap"] for r in runs)
        if args.method == "nsa":
            cell["nsa_compressed_slots"] = ar_methods.nsa_compressed_slots(cfg.seqlen, mcfg)
        cell["runs"] = runs
        log(f"{args.method} seqlen {args.seqlen} d_model {args.d_model}: accuracy {cell['accuracy']:.4f} "
            f"ci95 {cell['ci95']} slots {cell['mean_slots']:.1f} step_ms {cell['step_ms'] or float('nan'):.1f} "
            f"steps {cell['steps_done']} of {args.steps}" + (" (hit the time cap)" if cell["hit_time_cap"] else ""))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(cell, f, indent=1)
    return cell


def run_collect(args):
    cells = []
    for p in sorted(glob.glob(os.path.join(args.cells, "*.json"))):
        with open(p) as f:
            cells.append(json.load(f))
    cells.sort(key=lambda c: (c["seqlen"], c["d_model"], ar_methods.METHODS.index(c["method"])))
    setups = [c.pop("setup") for c in cells]
    timed = {}
    for p in sorted(glob.glob(os.path.join(args.timing, "*.json"))) if args.timing else []:
        with open(p) as f:
            t = json.load(f)
        timed[(t["seqlen"], t["d_model"], t["method"])] = t["step_ms"]
    for c in cells:
        key = (c["seqlen"], c["d_model"], c["method"])
        if key in timed:
            c["step_ms_concurrent"], c["step_ms"] = c["step_ms"], timed[key]
    for c in cells:
        for r in c.get("runs", []):
            r.pop("correct_per_sequence", None)  # kept in the cell files, not in the summary
    # A cell whose training stopped at the time cap took fewer steps than the others: not comparable.
    early = [f"{c['seqlen']}x{c['d_model']} {c['method']}: steps {c['steps_done']} of {c['steps']}"
             for c in cells if c.get("hit_time_cap")]
    doc = {"device": args.device or (setups[0]["device"] if setups else None),
           "setup": setups[0] if setups else {}, "stopped_early": early, "cells": cells}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"collect: {len(cells)} cells -> {args.out}")
    for e in early:
        print(f"collect: stopped early at the time cap, not step-matched: {e}")
    return doc


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--seqlen", type=int, required=True)
    t.add_argument("--d-model", type=int, required=True)
    t.add_argument("--method", required=True, choices=ar_methods.METHODS)
    t.add_argument("--seeds", type=int, nargs="+", default=[0])
    t.add_argument("--steps", type=int, default=300, help="optimizer steps per seed, the same for every method")
    t.add_argument("--time-cap-s", type=float, default=0.0,
                   help="safety net: stop a seed's training after this many seconds (0: none); reported")
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--n-train", type=int, default=1_000_000,
                   help="training pool size; examples are generated on the fly, so a pool larger than "
                        "steps x batch costs nothing and no example repeats (a 32K pool was memorized)")
    t.add_argument("--n-test", type=int, default=256)
    t.add_argument("--eval-batch", type=int, default=16)
    t.add_argument("--n-kv", type=int, default=256)
    t.add_argument("--n-q", type=int, default=256)
    t.add_argument("--n-pass", type=int, default=1)
    t.add_argument("--vocab", type=int, default=8192)
    t.add_argument("--power-a", type=float, default=0.01)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--conv", type=int, default=3,
                   help="taps of the short causal depthwise conv on each attention input (0: none, the first model)")
    t.add_argument("--ceiling", type=int, default=1024)
    t.add_argument("--moba-block", type=int, default=128)
    t.add_argument("--nsa-block", type=int, default=64)
    t.add_argument("--nsa-window", type=int, default=128)
    t.add_argument("--skip-steps", type=int, default=5, help="steps left out of step_ms (warm-up)")
    t.add_argument("--log-every", type=int, default=100)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--out", default="")
    c = sub.add_parser("collect")
    c.add_argument("--cells", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--device", default="")
    c.add_argument("--timing", default="", help="cells of short runs timed one at a time")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.cmd == "train":
        run_train(args)
    else:
        run_collect(args)


if __name__ == "__main__":
    main()

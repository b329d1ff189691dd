#!/usr/bin/env python3
"""Needle-in-a-haystack retrieval with MALA in prefill and decode (issue #31, part 2), RULER-style.

The haystack is real code (lab/real/corpus.py: a package of CPython's standard library, a
different one per trial, cut to the length).  Needles are Python comment lines stating a fact,
inserted at a depth (0% .. 100% of the haystack, at a line boundary); the prompt ends with a
question as a comment and the start of the answer, and the model continues it greedily:

    # The secret number of <key> is <value>.        (the needle, somewhere in the haystack)
    ...
    # Question: what is the secret number of <key>?
    # Answer: the secret number of <key> is

Variants: "single" (one needle) and "multikey" (4 needles with different keys and values; the
question asks for one of them).  A trial is correct when the continuation's first number equals the
needle's value.  Every trial runs with dense attention (SDPA) and with MALA at each tau, in prefill
(mala.attention) and in decode (mala.attention_with_kvcache on transformers' cache): the attention
function of lab/real/qwen_eval.py.  Keys, values, depths and haystacks are drawn from a seed, the
same for every configuration.  Accuracy per (length, variant, configuration), with a Wilson 95%
interval, and the paired difference against dense.

    python3 lab/real/qwen_niah.py --gguf /tmp/mala-real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --out $OUT --lengths 4096,8192,16384,32768 --trials 50 --taus 1

Writes OUT/qwen_niah.json ("niah": per length {"dense", "mala_tau1", "trials", ...} in percent).
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import corpus  # noqa: E402
import qwen_eval  # noqa: E402
import qwen_measure as qm  # noqa: E402

WORDS = ("alpha", "bravo", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
         "kestrel", "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra")


def wilson(k, n):
    """(lower, upper) of the Wilson 95% interval of k successes in n, in percent."""
    if n == 0:
        return float("nan"), float("nan")
    z, p = 1.96, k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * (c - h), 100 * (c + h)


def make_trial(rng, tok, haystack_ids, n_tokens, variant):
    """(prompt token ids of about n_tokens, expected value string, trial description)."""
    n_needles = 1 if variant == "single" else 4
    keys = rng.sample(WORDS, n_needles)
    values = [str(rng.randrange(100000, 1000000)) for _ in keys]
    ask = rng.randrange(n_needles)
    needles = [tok.encode(f"# The secret number of {k} is {v}.\n").ids for k, v in zip(keys, values)]
    question = tok.encode(f"\n# Question: what is the secret number of {keys[ask]}?\n"
                          f"# Answer: the secret number of {keys[ask]} is").ids
    # (16 tokens of slack: re-encoding the haystack with the needles can merge or split a few tokens.)
    budget = n_tokens - len(question) - sum(len(x) for x in needles) - 16
    if budget <= 0:
        raise RuntimeError(f"niah: {n_tokens} tokens leave no room for a haystack beside the needles")
    hay = tok.decode(haystack_ids[:budget])
    lines = hay.split("\n")
    depths = [rng.random() for _ in needles]
    # Insert from the deepest, so earlier positions stay valid; each at a line boundary.
    placed = sorted(zip(depths, range(n_needles)), reverse=True)
    for depth, i in placed:
        at = round(depth * len(lines))
        lines.insert(at, f"# The secret number of {keys[i]} is {values[i]}.")
    ids = tok.encode("\n".join(lines)).ids + question
    if len(ids) > n_tokens:
        raise RuntimeError(f"niah: a prompt of {len(ids)} tokens exceeds the length {n_tokens}")
    return ids, values[ask], {"keys": keys, "values": values, "asked": ask, "depths": depths, "tokens": len(ids)}


def answer(model, tok, ids, n_new):
    x = torch.tensor(ids, device=qm.DEVICE["name"]).view(1, -1)
    with torch.no_grad():
        y = model.generate(x, max_new_tokens=n_new, do_sample=False, pad_token_id=tok.token_to_id("<|endoftext|>"))
    return tok.decode(y[0, len(ids):].tolist())


def is_correct(text, want):
    """The scorer: the continuation's first number equals the needle's value."""
    got = re.findall(r"\d+", text)
    return bool(got) and got[0] == want


def haystacks(tok, n):
    """[(package, token ids)] of every corpus package that reaches n tokens, in the corpus' order."""
    hays = []
    for pkg in corpus.PACKAGES:
        try:
            seqs, _ = corpus.build(lambda s: tok.encode(s).ids, n, 1, packages=(pkg,))
            hays.append((pkg, seqs[0]))
        except RuntimeError:
            continue
    if not hays:
        raise RuntimeError("niah: no corpus package reaches the longest length")
    return hays


def make_trials(tok, hays, n, variant, count, seed):
    """`count` trials [(ids, expected value, description, haystack package)] of about n tokens, drawn
    from the seed (the same for every configuration), the haystacks used in turn."""
    rng = random.Random(f"{seed}-{n}-{variant}")
    return [make_trial(rng, tok, hays[t % len(hays)][1], n, variant) + (hays[t % len(hays)][0],)
            for t in range(count)]


def run_trials(model, tok, trials, tau, n_new):
    """(correct [bool], continuations [str]) of the trials with qwen_eval.MODE['tau'] = tau."""
    correct, outs = [], []
    for ids, want, _, _ in trials:
        qwen_eval.MODE["tau"], qwen_eval.MODE["stats"] = tau, []
        text = answer(model, tok, ids, n_new)
        correct.append(is_correct(text, want))
        outs.append(text)
    return correct, outs


def main():
    ap = qwen_eval.parser(__doc__)
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--variants", default="single,multikey")
    ap.add_argument("--taus", default="1")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=31)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    configs = [("dense", None)] + [(f"mala_tau{float(t):g}", float(t)) for t in args.taus.split(",")]
    res, tok, _, model = qwen_eval.setup(args, "qwen_niah.json", qwen_eval.eval_attention)
    # Haystacks: every package of the corpus that reaches the longest length, used in turn.
    hays = haystacks(tok, max(lengths))
    raw = res.data.setdefault("raw", {})
    summary = res.data.setdefault("niah", {})
    for n in lengths:
        entry = summary.setdefault(str(n), {"trials": args.trials})
        for variant in variants:
            trials = make_trials(tok, hays, n, variant, args.trials, args.seed)
            rows = raw.setdefault(f"{n}/{variant}", {"trials": [t[2] | {"haystack": t[3]} for t in trials]})
            t0 = time.time()
            for name, tau in configs:
                correct, outs = run_trials(model, tok, trials, tau, args.new_tokens)
                rows[name] = {"correct": correct, "outputs": outs}
                acc = 100.0 * sum(correct) / len(correct)
                lo, hi = wilson(sum(correct), len(correct))
                entry[f"{variant}_{name}"] = acc
                entry[f"{variant}_{name}_ci95"] = [lo, hi]
                if name != "dense":
                    dense = rows["dense"]["correct"]
                    entry[f"{variant}_{name}_disagreements"] = sum(a != b for a, b in zip(correct, dense))
                qm.log(f"{n} {variant:8s} {name:12s} {acc:5.1f}% [{lo:.1f}, {hi:.1f}]  ({time.time() - t0:.0f} s)")
                res.save()
        # The summary keys: both variants pooled.
        for name, _ in configs:
            vals = [entry[f"{v}_{name}"] for v in variants]
            entry[name] = sum(vals) / len(vals)
        res.save()
    qm.log("done")


if __name__ == "__main__":
    main()

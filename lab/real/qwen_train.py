#!/usr/bin/env python3
"""Continued-training parity (issue #31, part 4): the same continued training of Qwen2.5-Coder-1.5B
with dense attention and with MALA (tau = 1 in forward and backward), from the same weights, data
order and seed.

Model: lab/real/qwen_measure.py's loader (the Q4_K_M GGUF dequantized), trained in fp32 master
weights under bf16 autocast, gradient checkpointing per layer, AdamW, linear warm-up then constant
learning rate.  Attention: lab/real/qwen_eval.py's function (SDPA, or mala.attention at tau; q, k,
v cast to bf16 for the kernels).  Data: real code (lab/real/corpus.py), one sequence of --seqlen
tokens per step: the standard library cut into consecutive sequences (corpus.chunks), each visited
once in an order drawn from --seed (a new order per further pass); the packages of HELD_OUT are
left out of it and give the held-out loss (one sequence each).  Logged per step: loss, step time; every --eval-every steps: held-out
loss, and for MALA the realized forward and backward slots per query of that step (mean over layers
and heads) and the paper's attention FLOPs per token and layer,
`4 a h d + 4 s_b h d + 2 s_f h d + 4 s_b h d` for MALA against `8 a h d + 6 a h d` dense,
a = (n + 1) / 2, with s_f, s_b the realized slots.

A device call lasts at most 10 minutes: --deadline-s stops the run and saves model and optimizer to
WORK/train_<attn>.pt; --resume continues from there (on the same machine, while it is held).

    python3 lab/real/qwen_train.py --gguf /tmp/mala-real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --out $OUT --attn mala --tau 1 --seqlen 16384 --steps 200 [--resume]

Writes OUT/qwen_train_<attn>.json ("steps": per step loss and time, "evals": held-out loss, slots,
FLOPs; "final": the last held-out loss).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import corpus  # noqa: E402
import qwen_eval  # noqa: E402
import qwen_measure as qm  # noqa: E402

# Held out for the evaluation loss, and left out of the training text.
HELD_OUT = ("http", "xml")

def sequence_loss(model, ids, chunk=2048):
    """Mean next-token loss (nats) of one sequence; the LM head and its loss in checkpointed chunks
    (the full logits of 16K tokens would take 10 GB)."""
    x = torch.tensor(ids, device=qm.DEVICE["name"]).view(1, -1)
    hidden = model.model(input_ids=x).last_hidden_state[0]
    n = hidden.shape[0] - 1
    total = hidden.new_zeros((), dtype=torch.float32)

    def part(h, y):
        return F.cross_entropy(model.lm_head(h).float(), y, reduction="sum")

    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        total = total + checkpoint(part, hidden[s:e], x[0, s + 1:e + 1], use_reentrant=False)
    return total / n


def attention_flops(n, h, d, layers, s_f=None, s_b=None):
    """The paper's attention FLOPs per token (summed over layers): dense 8ahd + 6ahd; MALA
    4ahd + 4 s_b hd + 2 s_f hd + 4 s_b hd, with a = (n + 1) / 2."""
    a = (n + 1) / 2
    if s_f is None:
        return layers * (8 * a * h * d + 6 * a * h * d)
    return layers * (4 * a * h * d + 4 * s_b * h * d + 2 * s_f * h * d + 4 * s_b * h * d)


def main():
    ap = qwen_eval.parser(__doc__)
    ap.add_argument("--attn", choices=("dense", "mala"), required=True)
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="save and stop after this many seconds")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(args.seed)
    # fp32 master weights (bf16 autocast on CUDA)
    res, tok, cfg, model = qwen_eval.setup(args, f"qwen_train_{args.attn}.json", qwen_eval.eval_attention,
                                           dtype=torch.float32)
    # The loader may leave parameters on read-only memory (the mmap'd weight cache, or numpy's arrays
    # on the CPU, where .to() is a no-op): training writes them, so each gets its own copy.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    qwen_eval.MODE["tau"] = args.tau if args.attn == "mala" else None

    tokenize = lambda s: tok.encode(s).ids  # noqa: E731
    held_out, held_manifest = corpus.build(tokenize, args.seqlen, len(HELD_OUT), packages=HELD_OUT)
    train, train_manifest = corpus.chunks(tokenize, args.seqlen, args.steps, exclude=HELD_OUT)
    if not train:
        raise RuntimeError(f"train: the library outside {HELD_OUT} holds no sequence of {args.seqlen} tokens")
    res.data["text"] = {"train": {k: v for k, v in train_manifest.items() if k != "files"},
                        "train_files": len(train_manifest["files"]),
                        "held_out": [m["package"] for m in held_manifest["sequences"]]}
    # Each chunk once, in an order drawn from the seed; a new order for every further pass.
    order = random.Random(args.seed)
    schedule = []
    while len(schedule) < args.steps:
        schedule += order.sample(range(len(train)), len(train))
    schedule = schedule[:args.steps]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    lr_at = lambda step: args.lr * min(1.0, (step + 1) / max(1, args.warmup))  # noqa: E731
    ckpt = os.path.join(args.work, f"train_{args.attn}.pt")
    start = 0
    if args.resume and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        qm.log(f"resumed at step {start}")
    steps, evals = res.data.setdefault("steps", []), res.data.setdefault("evals", [])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.device == "cuda" else torch.autocast("cpu",
                                                                                                      enabled=False)
    heads, dim = cfg.num_attention_heads, cfg.head_dim

    def evaluate(step):
        model.eval()
        with torch.no_grad(), autocast:
            qwen_eval.MODE["stats"] = []
            loss = statistics.fmean(float(sequence_loss(model, h)) for h in held_out)
        model.train()
        evals.append({"step": step, "held_out_loss": loss})
        qm.log(f"step {step}: held-out loss {loss:.5f}")
        res.data["final"] = {"step": step, "held_out_loss": loss}
        res.save()

    if start == 0 and not evals:
        evaluate(0)
    step = start
    for step in range(start, args.steps):
        if time.time() - t_start > args.deadline_s:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.time()
        qwen_eval.MODE["stats"] = []
        with autocast:
            loss = sequence_loss(model, train[schedule[step]])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        row = {"step": step + 1, "loss": float(loss.detach()), "seconds": time.time() - t, "sequence": schedule[step]}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            stats = qwen_eval.MODE["stats"]
            if stats:  # (a checkpointed layer may run its forward twice: only the one its backward saw has bwd slots)
                s_f = statistics.fmean(s.mean_fwd_slots for s in stats)
                s_b = statistics.fmean(s.mean_bwd_slots for s in stats if s.bwd_slots is not None)
                row.update(fwd_slots_per_query=s_f, bwd_slots_per_query=s_b,
                           attention_flops_per_token=attention_flops(args.seqlen, heads, dim, cfg.num_hidden_layers,
                                                                     s_f, s_b))
            row["dense_attention_flops_per_token"] = attention_flops(args.seqlen, heads, dim, cfg.num_hidden_layers)
            steps.append(row)
            evaluate(step + 1)
        else:
            steps.append(row)
        qm.log(f"step {step + 1}: loss {row['loss']:.5f} ({row['seconds']:.2f} s)")
    else:
        step = args.steps
    done = step if step < args.steps else args.steps
    if done < args.steps:
        os.makedirs(args.work, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, ckpt)
        qm.log(f"deadline: saved step {done} to {ckpt}; rerun with --resume")
    res.data["completed_steps"] = done
    if done:
        times = [r["seconds"] for r in steps[1:]] or [r["seconds"] for r in steps]
        res.data["median_step_seconds"] = statistics.median(times)
    res.save()
    qm.log("done" if done == args.steps else "paused")


if __name__ == "__main__":
    main()

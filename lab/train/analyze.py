#!/usr/bin/env python3
"""After training: each trained model's step time, its real regime, and its attention's speed.

  timing   WORK/<size>_<arm>_<stage>.final.pt, --steps training steps at the stage's length (fresh
           AdamW state, after 3 warm-up steps): step time, and the attention's forward and backward
           time summed over layers (CUDA events, attn.py's "timed"), the rest by difference
  regime   the model's held-out sequences at every --lengths prefix, MALA tau (mala_stats) forward
           and backward: per layer slots per query and retained tiles; then each layer's captured
           Q, K (after RoPE), V at every length: MALA tau against tau = 0 on identical states with a
           fixed random dO probe (the Fig. 2 protocol of docs/real.md): omitted mass, relative error
           of O, dQ, dK, dV per head; --save-states DIR writes sequence 0's states (float16 .npy,
           layerLL_{q,k,v}.npy, the layout `mala_bench --real`, the suite and matched_work.py read)
  speed    every layer's attention at --n on sequence 0's states: forward and backward of MALA tau,
           MALA 0 and cuDNN SDPA (the suite's systems and timer: L2 flushed, median)
  grads    the gradient's fidelity: --sequences held-out sequences at --seqlen through the trained
           model, the whole model's parameter gradient under the training's bf16 autocast with each
           attention (SDPA, SDPA's memory-efficient kernel, MALA at tau = 0 and at --tau) against the
           same model's gradient in fp32 without autocast (SDPA's math kernel): relative L2 error and
           cosine per attention, and each loss; whether MALA's kernels at tau = 0 are as faithful as
           torch's own, which the control arm's loss cannot tell apart from trajectories drifting;
           also against the same bf16 model with its attention alone in fp32 ("sdpa_fp32"): each
           attention's own error and its bias (the error's component along that gradient), over
           --batches disjoint batches

    python3 lab/train/analyze.py timing --work W --out O --size s4m --arm mala --stage lct --seqlen 16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.append(os.path.join(ROOT, "lab", "real"))  # fidelity.py, after this folder's modules

import mala  # noqa: E402

import attn  # noqa: E402
from fidelity import layer_metrics  # noqa: E402  (lab/real: the Fig. 2 protocol)
import code_corpus as corpus  # noqa: E402
import train  # noqa: E402


SUITE = os.path.join(ROOT, "lab", "suite")


def load(args, device):
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(args.tokenizer).get_vocab_size()
    if args.random_init:
        return train.build_model(args.size, vocab, args.arm, device, None, args.seed)
    w = os.path.join(args.work, f"{train.run_tag(args.size, args.arm, args.stage, args.seed)}.final.pt")
    return train.build_model(args.size, vocab, args.arm, device, w, args.seed)


def train_batches(args, batch, vocab_hint=32768):
    """The timing's batches: the training stream, or (--data random) uniform random tokens."""
    if args.data == "random":
        rng = np.random.default_rng(12345)
        while True:
            yield 0, rng.integers(0, vocab_hint, size=(batch, args.seqlen), dtype=np.int64)
    seqs = corpus.sequences(np.load(os.path.join(args.data, "train.npy"), mmap_mode="r"), args.seqlen)
    yield from train.batches(seqs, batch, 12345)


def merge(path, key, value):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    doc = json.load(open(path)) if os.path.exists(path) else {}
    doc[key] = value
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def cmd_timing(args, device):
    model = load(args, device)
    attn.TIMED["inner"] = train.own_attention(args.arm)
    attn.set_attention(model, "timed")
    opt = train.optimizer(model, 1e-5, device)
    batch = max(1, args.tokens_per_step // args.seqlen)
    data = train_batches(args, batch)
    rows = []
    for i in range(3 + args.steps):
        x = torch.from_numpy(next(data)[1].astype(np.int64)).to(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        train.train_step(model, opt, x, device, args.compile_loss)
        e1.record()
        torch.cuda.synchronize()
        f, b = attn.take_timings()
        if i >= 3:
            rows.append((e0.elapsed_time(e1), f, b))
    r = np.median(np.array(rows), axis=0)
    res = {"seqlen": args.seqlen, "tokens_per_step": batch * args.seqlen, "steps": args.steps,
           "step_ms": float(r[0]), "attn_fwd_ms": float(r[1]), "attn_bwd_ms": float(r[2]),
           "rest_ms": float(r[0] - r[1] - r[2]), "attention": attn.TIMED["inner"], "compile_loss": args.compile_loss,
           "weights": "random" if args.random_init else "trained", "data": "random" if args.data == "random" else "train"}
    key = (f"{train.run_tag(args.size, args.arm, args.stage, args.seed)}_{args.seqlen}"
           + "_random" * args.random_init + "_compiled" * args.compile_loss)
    merge(os.path.join(args.out, "timing.json"), key, res)
    train.log(f"timing {args.size} {args.arm} {args.stage} N={args.seqlen}: {res}")
    if args.profile:
        # Where "rest" goes: two more steps under torch.profiler, the kernels by total CUDA time.
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                x = torch.from_numpy(next(data)[1].astype(np.int64)).to(device)
                train.train_step(model, opt, x, device, args.compile_loss)
            torch.cuda.synchronize()
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=80))


def capture_states(model, x):
    """Every layer's (q, k, v) as [N, H, d] after RoPE, from one forward of x [1, N]."""
    got = {}

    def cap(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        got[module.layer_idx] = tuple(t[0].transpose(0, 1).detach().clone() for t in (query, key, value))
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kw)

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("capture", cap)
    AttentionMaskInterface.register("capture", ALL_MASK_ATTENTION_FUNCTIONS["mala"])
    before = model.config._attn_implementation
    attn.set_attention(model, "capture")
    with torch.no_grad(), train.autocast(x.device):
        model.model(input_ids=x)
    attn.set_attention(model, before)
    return [got[i] for i in sorted(got)]


def lowp(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cmd_regime(args, device):
    model = load(args, device)
    model.eval()
    nmax = max(args.lengths)
    held = corpus.sequences(np.load(os.path.join(args.data, "heldout.npy"), mmap_mode="r"), nmax)[: args.sequences]
    out = {"lengths": {}, "fidelity": {}, "sequences": int(len(held))}
    gen = torch.Generator(device=device).manual_seed(1000)
    for s, ids in enumerate(held):
        x = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        for n in args.lengths:
            attn.RECORD["tau"] = args.tau
            attn.set_attention(model, "mala_stats")
            with train.autocast(device):
                loss = train.sequence_loss(model, x[:, :n])
            loss.backward()
            model.zero_grad(set_to_none=True)
            layers = attn.take_stats()
            out["lengths"].setdefault(str(n), []).append({"loss": float(loss.detach()), "layers": layers})
        states = capture_states(model, x)
        if s == 0 and args.save_states:
            os.makedirs(args.save_states, exist_ok=True)
            for li, (q, k, v) in enumerate(states):
                for name, t in (("q", q), ("k", k), ("v", v)):
                    np.save(os.path.join(args.save_states, f"layer{li:02d}_{name}.npy"),
                            t[: args.save_n].float().half().cpu().numpy())
        for n in args.lengths:
            per_layer = []
            for q, k, v in states:
                qq, kk, vv = (t[:n].unsqueeze(0).to(lowp(device)) for t in (q, k, v))
                dout = torch.randn(qq.shape, generator=gen, device=device).to(qq.dtype)
                per_layer.append(layer_metrics(mala, qq, kk, vv, dout, [args.tau])[0][args.tau])
            out["fidelity"].setdefault(str(n), []).append(per_layer)
        train.log(f"regime {args.size} {args.arm} sequence {s}: fwd slots "
                  + ", ".join(f"{n}: {np.mean([x['fwd_slots'] for x in out['lengths'][str(n)][-1]['layers']]):.0f}"
                              for n in args.lengths))
        del states
        torch.cuda.empty_cache()
    merge(os.path.join(args.out, "regime.json"), train.run_tag(args.size, args.arm, args.stage, args.seed), out)


def cmd_grads(args, device):
    import gradcheck

    model = load(args, device)
    held = corpus.sequences(np.load(os.path.join(args.data, "heldout.npy"), mmap_mode="r"), args.seqlen)
    xs = gradcheck.batches(held, args.batches, args.sequences, device)
    res = gradcheck.probe(model, xs, device, args.tau, (train.own_attention(args.arm), train.train_tau(args.arm, args.tau)),
                          log=lambda m: train.log(f"grads {args.size} {args.arm} {m}"))
    out = {"seqlen": args.seqlen, "sequences": args.sequences, "batches": args.batches,
           "reference": "fp32, no autocast, SDPA math",
           "reference_attention": "bf16 autocast, attention alone in fp32 (SDPA math): the attention's own error",
           "attention": res["attention"], "loss_reference": res["loss_reference"]}
    merge(os.path.join(args.out, "grads.json"), f"{train.run_tag(args.size, args.arm, args.stage, args.seed)}_{args.seqlen}",
          out)


def cmd_speed(args, device):
    sys.path.insert(0, SUITE)
    import systems
    import timing

    model = load(args, device)
    model.eval()
    ids = corpus.sequences(np.load(os.path.join(args.data, "heldout.npy"), mmap_mode="r"), args.n)[0]
    states = capture_states(model, torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device))
    del model
    syss = {"mala_tau1": systems.Mala(args.tau), "mala_tau0": systems.Mala(0.0), "cudnn": systems.SDPA("cudnn")}
    for s in syss.values():
        why = s.available()
        if why:
            raise RuntimeError(f"speed: {s.name} unavailable: {why}")
    # FlashAttention-4 where its wheels were installed (gpu_run.sh FA4_SITE); its absence is recorded.
    fa4, unavailable = systems.FA4(), {}
    why = fa4.available()
    if why:
        unavailable["fa4"] = why
        train.log(f"speed: fa4 unavailable: {why}")
    else:
        syss["fa4"] = fa4
    gen = torch.Generator(device=device).manual_seed(7)
    res = {k: {"fwd_ms": [], "bwd_ms": []} for k in syss}
    for q, k, v in states:
        qq, kk, vv = (t.unsqueeze(0).to(torch.bfloat16) for t in (q, k, v))
        dout = torch.randn(qq.shape, generator=gen, device=device).to(qq.dtype)
        for name, s in syss.items():
            p = s.prepare(qq, kk, vv, dout)
            f = timing.measure(p.make_graph, min_reps=20, max_reps=30, target_s=0.2)
            b = timing.measure(p.bwd, setup=p.make_graph, min_reps=20, max_reps=30, target_s=0.2)
            res[name]["fwd_ms"].append(f["ms"])
            res[name]["bwd_ms"].append(b["ms"])
            del p
    tot = {k: {"fwd_ms": sum(v["fwd_ms"]), "bwd_ms": sum(v["bwd_ms"]), "layers": v} for k, v in res.items()}
    tot.update({k: {"unavailable": why} for k, why in unavailable.items()})
    merge(os.path.join(args.out, "speed.json"), f"{train.run_tag(args.size, args.arm, args.stage, args.seed)}_{args.n}", tot)
    train.log(f"speed {args.size} {args.arm} N={args.n}: "
              + ", ".join(f"{k} fwd {v['fwd_ms']:.3f} bwd {v['bwd_ms']:.3f} ms" for k, v in tot.items() if k in res))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("timing", "regime", "speed", "grads"))
    ap.add_argument("--size", required=True)
    ap.add_argument("--arm", required=True, choices=train.ARMS)
    ap.add_argument("--stage", default="lct", choices=("pt", "lct"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "tokenizer.json"))
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42, help="which seed's run (train.py --seed)")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--batches", type=int, default=1, help="grads: disjoint batches of --sequences held-out sequences")
    ap.add_argument("--save-states", default="")
    ap.add_argument("--save-n", type=int, default=8192)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--device", default="cuda", help="cpu: the regime step only, for the tests")
    ap.add_argument("--profile", default="", help="timing: also write a torch.profiler table of two steps here")
    ap.add_argument("--compile-loss", action="store_true", help="timing: the loss through torch.compile")
    ap.add_argument("--random-init", action="store_true",
                    help="timing: the seed's initial weights instead of a trained model (--data random: random tokens)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    device = torch.device(a.device)
    # The integration at the arm's training tau (timing); regime and speed pass their tau per call.
    attn.register(train.train_tau(a.arm, a.tau))
    t = time.time()
    {"timing": cmd_timing, "regime": cmd_regime, "speed": cmd_speed, "grads": cmd_grads}[a.cmd](a, device)
    train.log(f"{a.cmd} took {time.time() - t:.1f} s")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One training run of the study: a Qwen3-like model from scratch (or from the pre-training stage's
weights), dense or MALA attention, one stage.

  --stage pt   pre-training at --seqlen (4K), WSD schedule from configs.py, from the seed's init
  --stage lct  long-context stage at --seqlen (16K) from the same seed's WORK/<size>_<arm>_pt.final.pt, constant
               LCT_LR_FACTOR x peak
  --arm dense  transformers' "sdpa" attention;  --arm mala: attn_implementation="mala" (the
               library's transformers integration) at --tau, forward and backward;  --arm mala0:
               the same integration at tau = 0 (exact attention through MALA's kernels), the control
               that separates the rule's cost from the kernels' numerics;  --arm dense_ea: torch's
               SDPA held to its memory-efficient kernel (attn.py "sdpa_ea"), a second exact attention:
               how far two dense runs of one seed drift apart from rounding alone (the noise floor)

Both arms of a size start from the same weights (the seed's init, or their own pre-training) and see
the same sequences in the same order (corpus.sequences of the token stream, a permutation per epoch
drawn from the seed).  bf16 autocast over fp32 master weights, AdamW, gradient clipping.

Every --eval-every steps, on a fixed held-out batch (the first sequences of the held-out stream):
held-out loss at 4K and at 16K under the arm's own attention, and the same batch with MALA at tau = 1
("mala_stats"): per layer, the kernels' realized forward and backward slots per query and retained
tile fractions (for the dense arm: what a dense-trained model would keep).  Attention FLOPs per
token by the paper's accounting (configs.attention_flops_per_token) from those slots.
--grad-probe-every: at step 0 and every that many steps, gradcheck.probe on fixed held-out batches at
--seqlen (the split's last sequences): each attention's gradient against fp32 attention on the
run's current weights, whether MALA's kernels step as SDPA's do at every stage of training, not
only on the final weights (analyze.py grads).

--budget-s: the number of steps is set after --probe-steps from the measured step time so that the
run ends within the budget; with --sync DIR the two arms of a size exchange their step times there
and both take the step count of the slower, so they train on the same tokens.  --steps fixes it.
--resume continues from WORK/<tag>.ckpt.pt (written every --ckpt-every steps and at --deadline-s).

Writes OUT/train_<tag>.json (after every eval) and WORK/<tag>.final.pt; <tag> is run_tag's
<size>_<arm>_<stage>[_s<seed>].
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attn  # noqa: E402
import configs  # noqa: E402
import code_corpus as corpus  # noqa: E402

T0 = time.time()


def log(msg):
    print(f"[train {time.time() - T0:7.1f}s] {msg}", flush=True)


def _chunk_loss(weight, hh, yy):
    """Summed next-token loss of one chunk: the LM head and a float32 cross-entropy."""
    return F.cross_entropy(F.linear(hh, weight).float(), yy, reduction="sum")


_COMPILED = {}


def chunk_loss_fn(compiled=False):
    """_chunk_loss, or the same function through torch.compile: Inductor fuses the float32 cast and the
    log-softmax into the reductions over the logits, which eager mode writes out in float32."""
    if not compiled:
        return _chunk_loss
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_chunk_loss, dynamic=False)
    return _COMPILED["fn"]


def sequence_loss(model, x, chunk=8192, compiled=False):
    """Mean next-token loss (nats) of a [B, N] batch; the LM head and its loss in checkpointed chunks
    so that the [B * N, vocab] logits are never held at once.  compiled: the chunks' loss through
    torch.compile (chunk_loss_fn)."""
    hidden = model.model(input_ids=x).last_hidden_state[:, :-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = x[:, 1:].reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    part = chunk_loss_fn(compiled)
    w = model.lm_head.weight
    for s in range(0, y.numel(), chunk):
        e = min(s + chunk, y.numel())
        total = total + checkpoint(part, w, h[s:e], y[s:e], use_reentrant=False)
    return total / y.numel()


def train_step(model, opt, x, device, compiled=False):
    """One optimizer step on the batch x: bf16 autocast, clipping at configs.CLIP, AdamW.
    Returns (loss, gradient norm) as tensors (no synchronization)."""
    with autocast(device):
        loss = sequence_loss(model, x, compiled=compiled)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), configs.CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, gnorm


def batches(seqs: np.ndarray, batch: int, seed: int):
    """(epoch, [batch, N] array) forever: each epoch a permutation of the sequences from the seed."""
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(seqs))
        for s in range(0, len(order) - batch + 1, batch):
            yield epoch, seqs[np.sort(order[s:s + batch])]
        epoch += 1


ARMS = ("dense", "mala", "mala0", "dense_ea")


def run_tag(size, arm, stage, seed=configs.SEED):
    """A run's name: <size>_<arm>_<stage>, with _s<seed> for any seed but the study's default."""
    return f"{size}_{arm}_{stage}" + ("" if seed == configs.SEED else f"_s{seed}")


def build_model(size, vocab, arm, device, init_from=None, seed=configs.SEED):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(configs.qwen3_config(size, vocab, attn="sdpa"))
    if init_from:
        model.load_state_dict(torch.load(init_from, map_location="cpu", weights_only=True))
    model.to(device)
    attn.set_attention(model, own_attention(arm))
    return model


def own_attention(arm):
    """The registered attention an arm trains with: MALA's integration (at the arm's tau, which
    register() fixed) for the MALA arms, torch's SDPA for dense, SDPA's second exact kernel for dense_ea."""
    return {"dense": "sdpa", "dense_ea": "sdpa_ea"}.get(arm, "mala")


def train_tau(arm, tau):
    """The tau an arm trains with: --tau for mala, 0 for mala0 and the dense arms."""
    return tau if arm == "mala" else 0.0


def optimizer(model, lr, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": configs.WEIGHT_DECAY},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=configs.BETAS,
                             fused=device.type == "cuda")


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def evaluate(model, arm, held, device, tau):
    """{len: {"loss", "layers": per-layer MALA work}} on the fixed held-out batches."""
    own = own_attention(arm)
    out = {}
    for n, x in held.items():
        xt = torch.from_numpy(x.astype(np.int64)).to(device)
        # MALA tau on the batch, forward and backward, for the kernels' counters (either arm).
        attn.RECORD["tau"] = tau
        attn.set_attention(model, "mala_stats")
        model.zero_grad(set_to_none=True)
        with autocast(device):
            loss_m = sequence_loss(model, xt)
        loss_m.backward()
        layers = attn.take_stats()
        model.zero_grad(set_to_none=True)
        attn.set_attention(model, own)
        if arm == "mala":
            loss = float(loss_m.detach())  # the arm's own attention (at the same tau) is the same call
        else:
            with torch.no_grad(), autocast(device):
                loss = float(sequence_loss(model, xt))
        out[str(n)] = {"loss": loss, "loss_with_mala": float(loss_m.detach()), "layers": layers}
    return out


def flops_from(ev, cfg, n):
    layers = ev[str(n)]["layers"]
    h, d, L = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    return (configs.attention_flops_per_token(n, h, d, L),
            configs.attention_flops_per_token(n, h, d, L, [x["fwd_slots"] for x in layers],
                                              [x["bwd_slots"] for x in layers]))


def agree_steps(sync, tag_pair, arm, ms, budget_left, step_now, max_steps, wait_s=180):
    """Both arms' step count: each writes its step time and remaining budget, then both take the
    same count from the slower arm's time and the smaller budget (so they train on the same tokens
    under the same schedule).  Without the other arm's file in wait_s, its own."""
    mine = os.path.join(sync, f"{tag_pair}_{arm}.json")
    with open(mine + ".tmp", "w") as f:
        json.dump({"ms": ms, "left": budget_left, "step": step_now}, f)
    os.replace(mine + ".tmp", mine)
    other = os.path.join(sync, f"{tag_pair}_{'mala' if arm == 'dense' else 'dense'}.json")
    t = time.time()
    while not os.path.exists(other) and time.time() - t < wait_s:
        time.sleep(1)
    theirs = json.load(open(other)) if os.path.exists(other) else {"ms": ms, "left": budget_left}
    return steps_for(max(ms, theirs["ms"]), min(budget_left, theirs["left"]), step_now, max_steps), theirs["ms"]


def steps_for(ms, budget_left, step_now, max_steps):
    """Total steps that fit the budget left at ms per step (8% kept for the evals), rounded down to
    a multiple of 10 so that two arms whose inputs differ by rounding still agree."""
    n = step_now + int(0.92 * budget_left * 1000 / ms)
    return max(step_now + 1, min(max_steps, n // 10 * 10))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", required=True, choices=sorted(configs.SIZES))
    ap.add_argument("--arm", required=True, choices=ARMS)
    ap.add_argument("--stage", default="pt", choices=("pt", "lct"))
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=configs.SEED,
                    help="the initial weights and the data order (both arms of a comparison take the same)")
    ap.add_argument("--data", required=True, help="corpus.build's folder (train.npy, heldout.npy)")
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "tokenizer.json"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True, help="checkpoints and final weights (stay on the machine)")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (0: from --budget-s)")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--probe-steps", type=int, default=40)
    ap.add_argument("--sync", default="", help="folder where the two arms agree on the step count")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-lengths", default="4096,16384")
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens per eval length")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=1e9)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile-loss", action="store_true", help="the training steps' loss through torch.compile")
    ap.add_argument("--grad-probe-every", type=int, default=0,
                    help="every this many steps (and at step 0), gradcheck.probe on fixed held-out batches (0: never)")
    ap.add_argument("--grad-probe-batches", type=int, default=2)
    ap.add_argument("--grad-probe-sequences", type=int, default=4, help="held-out sequences of --seqlen per probe batch")
    a = ap.parse_args()
    device = torch.device(a.device)
    attn.register(train_tau(a.arm, a.tau))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(a.tokenizer).get_vocab_size()
    tag = run_tag(a.size, a.arm, a.stage, a.seed)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    train_seqs = corpus.sequences(np.load(os.path.join(a.data, "train.npy"), mmap_mode="r"), a.seqlen)
    held_stream = np.load(os.path.join(a.data, "heldout.npy"), mmap_mode="r")
    held = {}
    for n in (int(x) for x in a.eval_lengths.split(",") if x):
        s = corpus.sequences(held_stream, n)
        held[n] = np.ascontiguousarray(s[: max(1, a.eval_tokens // n)])
    probe_x = []
    if a.grad_probe_every:
        # The probe's batches: held-out sequences of the training length, from the split's end (the
        # evals read its start), the same at every probe.
        import gradcheck

        s = corpus.sequences(held_stream, a.seqlen)
        need = a.grad_probe_batches * a.grad_probe_sequences
        probe_x = gradcheck.batches(s[max(0, len(s) - need):], a.grad_probe_batches, a.grad_probe_sequences, device,
                                    ("--grad-probe-batches", "--grad-probe-sequences"))
    batch = max(1, a.tokens_per_step // a.seqlen)
    peak = configs.SIZES[a.size]["lr"]
    init = os.path.join(a.work, f"{run_tag(a.size, a.arm, 'pt', a.seed)}.final.pt") if a.stage == "lct" else None
    model = build_model(a.size, vocab, a.arm, device, init, a.seed)
    cfg = model.config
    opt = optimizer(model, peak, device)
    rec = {"size": a.size, "arm": a.arm, "stage": a.stage, "seed": a.seed,
           "tau": train_tau(a.arm, a.tau), "seqlen": a.seqlen, "batch": batch, "tokens_per_step": batch * a.seqlen, "peak_lr": peak,
           "params": sum(p.numel() for p in model.parameters()),
           "non_embedding_params": configs.non_embedding_params(model),
           "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim", "intermediate_size",
                                                    "vocab_size")},
           "train_sequences": int(len(train_seqs)), "heldout_batch": {str(n): list(x.shape) for n, x in held.items()},
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "compile_loss": a.compile_loss, "steps": [], "evals": [], "grad_probes": [], "total_steps": a.steps or None}
    step, attn_flops = 0, {"dense": 0.0, "arm": 0.0}
    ckpt = os.path.join(a.work, f"{tag}.ckpt.pt")
    if a.resume and os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        rec, step, attn_flops = st["rec"], st["step"], st["attn_flops"]
        log(f"{tag}: resumed at step {step}")
    total = rec["total_steps"] or a.max_steps
    data = batches(train_seqs, batch, a.seed + (0 if a.stage == "pt" else 1))
    for _ in range(step):  # the data order does not depend on where a run was cut
        next(data)
    t_run = time.time()
    last_eval = None

    def save_json():
        path = os.path.join(a.out, f"train_{tag}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)

    def do_eval():
        nonlocal last_eval
        model.eval()
        t = time.time()
        ev = evaluate(model, a.arm, held, device, a.tau)
        model.train()
        n = a.seqlen
        dense_f, mala_f = flops_from(ev, cfg, n) if str(n) in ev else (None, None)
        entry = {"step": step, "tokens": step * batch * a.seqlen, "attn_flops_dense": attn_flops["dense"],
                 "attn_flops_arm": attn_flops["arm"], "eval_s": time.time() - t, **{f"len_{k}": v for k, v in ev.items()},
                 "attn_flops_per_token_dense": dense_f, "attn_flops_per_token_mala": mala_f}
        rec["evals"].append(entry)
        last_eval = entry
        parts = [f"{k}: loss {v['loss']:.4f} fwd slots {np.mean([x['fwd_slots'] for x in v['layers']]):.0f}"
                 for k, v in ev.items()]
        log(f"{tag} step {step}: " + "; ".join(parts) + f" ({time.time() - t:.1f} s)")
        save_json()

    def do_probe():  # gradcheck: imported above, where probe_x was made
        t = time.time()
        res = gradcheck.probe(model, probe_x, device, a.tau, (own_attention(a.arm), train_tau(a.arm, a.tau)))
        rec.setdefault("grad_probes", []).append({"step": step, "seqlen": a.seqlen, "sequences": a.grad_probe_sequences,
                                                  "probe_s": time.time() - t, **res})
        g = res["attention"]
        log(f"{tag} step {step}: gradient vs fp32 attention: " + ", ".join(
            f"{k} {v['attn_rel_err']:.2e} (bias {v['attn_bias']:+.1e})" for k, v in g.items())
            + f"; mala_tau0 from sdpa {g['mala_tau0']['rel_to_sdpa']:.2e}, sdpa_ea {g['sdpa_ea']['rel_to_sdpa']:.2e}"
            + f" ({time.time() - t:.1f} s)")
        save_json()

    if step == 0:
        do_eval()
        if probe_x:
            do_probe()
    window = []
    while step < total:
        if time.time() - T0 > a.deadline_s:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rec": rec, "step": step,
                        "attn_flops": attn_flops}, ckpt)
            log(f"{tag}: deadline at step {step}; checkpoint {ckpt} (--resume continues)")
            save_json()
            return
        lr = configs.wsd_lr(step, total, peak) if a.stage == "pt" else peak * configs.LCT_LR_FACTOR
        for g in opt.param_groups:
            g["lr"] = lr
        epoch, xb = next(data)
        x = torch.from_numpy(xb.astype(np.int64)).to(device, non_blocking=True)
        t = time.perf_counter()
        loss, gnorm = train_step(model, opt, x, device, a.compile_loss)
        lv = float(loss)  # synchronizes: the step's time is measured to here
        ms = (time.perf_counter() - t) * 1000
        window.append(ms)
        # Attention FLOPs of this step's tokens, with the slots of the latest eval at this length.
        n_tok = batch * a.seqlen
        if last_eval is not None and last_eval["attn_flops_per_token_dense"] is not None:
            attn_flops["dense"] += n_tok * last_eval["attn_flops_per_token_dense"]
            attn_flops["arm"] += n_tok * (last_eval["attn_flops_per_token_mala"] if train_tau(a.arm, a.tau) > 0
                                          else last_eval["attn_flops_per_token_dense"])
        step += 1
        if not math.isfinite(lv):
            log(f"{tag}: loss {lv} at step {step}; stopping")
            rec["diverged_at"] = step
            break
        if step % 10 == 0 or step == total:
            rec["steps"].append({"step": step, "loss": lv, "lr": lr, "grad_norm": float(gnorm), "epoch": epoch,
                                 "ms": float(np.median(window))})
            window = []
        if a.steps == 0 and rec["total_steps"] is None and step == a.probe_steps:
            ms_probe = float(np.median([s["ms"] for s in rec["steps"][-2:]]))
            left = a.budget_s - (time.time() - t_run)
            if a.sync:
                total, other = agree_steps(a.sync, run_tag(a.size, "pair", a.stage, a.seed), a.arm, ms_probe, left,
                                           step, a.max_steps)
            else:
                total, other = steps_for(ms_probe, left, step, a.max_steps), None
            rec["total_steps"] = total
            rec["probe"] = {"ms": ms_probe, "other_arm_ms": other, "budget_left_s": left}
            log(f"{tag}: probe {ms_probe:.1f} ms/step (other arm {other}); {total} steps")
        if step % a.eval_every == 0 or step == total:
            do_eval()
        if probe_x and (step % a.grad_probe_every == 0 or step == total):
            do_probe()
        if a.ckpt_every and step % a.ckpt_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rec": rec, "step": step,
                        "attn_flops": attn_flops}, ckpt)
    rec["final"] = {"step": step, "tokens": step * batch * a.seqlen, "wall_s": time.time() - t_run,
                    **{f"heldout_loss_{k}": v["loss"] for k, v in
                       ((k[4:], v) for k, v in rec["evals"][-1].items() if k.startswith("len_"))}}
    save_json()
    torch.save(model.state_dict(), os.path.join(a.work, f"{tag}.final.pt"))
    log(f"{tag}: done, {step} steps, {rec['final']}")


if __name__ == "__main__":
    main()

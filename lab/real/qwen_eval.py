#!/usr/bin/env python3
"""Perplexity of Qwen2.5-Coder-1.5B with dense attention and with MALA in the loop (issue #31, part 1).

The model (lab/real/qwen_measure.py's loader: GGUF -> transformers Qwen2, bf16, CUDA) reads real
code text (lab/real/corpus.py: packages of CPython's standard library, one per sequence, the
first N tokens) at each length.  Every attention layer of the forward runs through one attention
function that calls either torch SDPA (dense; cuDNN or flash, PyTorch's choice) or mala.attention at
a tau, so the whole model computes with MALA's retained tiles.  Per (length, configuration, sequence):
the mean next-token loss over the sequence (nats), and for MALA the realized forward slots per
query averaged over layers and heads.  Perplexity = exp(mean loss).  The relative difference of a
configuration against dense is computed per sequence, then averaged, with a 95% t-interval over the
sequences (the sequences are the independent units).

    python3 lab/real/qwen_eval.py --gguf /tmp/mala-real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --out $OUT --lengths 8192,16384,32768 --sequences 8 --taus 0,0.5,1,2,4

Writes OUT/qwen_eval.json (the summary under "perplexity", every per-sequence value under "raw").
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import corpus  # noqa: E402
import gguf_qwen2  # noqa: E402
import qwen_measure as qm  # noqa: E402

# t quantiles (two-sided 95%) for small samples: df -> t
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}

MODE = {"tau": None, "stats": []}  # the configuration, and MALA's AttentionStats of each prefill layer


def eval_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (query/key/value [B, H, N, d]).  Dense when MODE['tau'] is
    None: SDPA (qwen_measure's, bottom-right causal when Nq < Nk).  Else MALA at that tau (a number,
    or a per-layer spec resolved by mala.layer_tau at the module's layer_idx): a prefill
    (Nq = Nk) through mala.attention, keeping its AttentionStats in MODE['stats'] (the backward fills
    their backward slots when training; None: no counters, for timing); a decode step (Nq < Nk:
    generate() with transformers' cache) through mala.attention_with_kvcache on that cache (the
    split-KV decode kernel, seeded).  On CUDA, fp32 inputs (RoPE's output under autocast,
    qwen_train) are cast to bf16 for the kernels."""
    import mala

    if query.is_cuda and query.dtype == torch.float32:
        query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
    if MODE["tau"] is None:
        return qm.capture_attention(module, query, key, value, attention_mask, scaling=scaling)
    tau = mala.layer_tau(MODE["tau"], getattr(module, "layer_idx", None))  # a number or a per-layer spec
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if q.shape[1] == k.shape[1]:
        if MODE["stats"] is None:  # timed runs: no counters
            return mala.attention(q, k, v, tau=tau, softmax_scale=scaling), None
        out, stats = mala.attention(q, k, v, tau=tau, softmax_scale=scaling, return_stats=True)
        MODE["stats"].append(stats)
        return out, None
    out = mala.attention_with_kvcache(q, k, v, k.shape[1], tau=tau, softmax_scale=scaling)
    return out, None


def sequence_losses(model, seqs, tau):
    """Per sequence of token ids: the mean next-token loss (nats), and MALA's forward slots per query
    and retained tile fraction, each the mean over the forward's layers (None where no MALA layer ran:
    dense).  tau: MODE['tau'] for the forwards (None, a number or a per-layer spec)."""
    losses, slots, retained = [], [], []
    for ids in seqs:
        MODE["tau"], MODE["stats"] = tau, []
        losses.append(float(qm.token_losses(model, ids).mean()))
        st = MODE["stats"]
        slots.append(statistics.fmean(s.mean_fwd_slots for s in st) if st else None)
        retained.append(statistics.fmean(s.fwd_retained_fraction for s in st) if st else None)
    return losses, slots, retained


def rel_diff(losses, dense):
    """The paired relative perplexity difference against dense: per sequence exp(loss - dense) - 1,
    its mean and the half-width of its 95% t-interval over the sequences."""
    return mean_ci([math.exp(a - b) - 1.0 for a, b in zip(losses, dense)])


def mean_ci(xs):
    """(mean, half-width of the 95% t-interval) of a small sample."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def parser(doc):
    """The arguments every model-in-the-loop script takes (qwen_eval, qwen_niah, qwen_e2e, qwen_train)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/mala-real/work")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: float32 smoke test")
    return ap


def setup(args, json_name, attention, dtype=None):
    """The run's results file (OUT/json_name), the tokenizer, and the model (config, model) with every
    attention layer through `attention`.  dtype: the weights' (default bf16 on CUDA, fp32 on the CPU)."""
    qm.DEVICE["name"] = args.device
    qm.DEVICE["dtype"] = dtype or (torch.bfloat16 if args.device == "cuda" else torch.float32)
    os.makedirs(args.out, exist_ok=True)
    res = qm.Results(os.path.join(args.out, json_name))
    res.data.update(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                    date=time.strftime("%Y-%m-%d"), args=vars(args))
    from transformers import AttentionInterface

    tok = gguf_qwen2.tokenizer(args.gguf)
    cfg, model, _ = qm.load_model(args, res, args.device)
    AttentionInterface.register(attention.__name__, attention)
    model.config._attn_implementation = attention.__name__
    return res, tok, cfg, model


def main():
    ap = parser(__doc__)
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--taus", default="0,0.5,1,2,4")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    taus = [float(x) for x in args.taus.split(",")]
    res, tok, _, model = setup(args, "qwen_eval.json", eval_attention)
    configs = [("dense", None)] + [(f"mala_tau{t:g}", t) for t in taus]
    raw = res.data.setdefault("raw", {})
    summary = res.data.setdefault("perplexity", {})
    for n in lengths:
        seqs, manifest = corpus.build(lambda s: tok.encode(s).ids, n, args.sequences, allow_fewer=True)
        qm.log(f"{n} tokens: {len(seqs)} sequences ({', '.join(s['package'] for s in manifest['sequences'])})")
        rows = raw.setdefault(str(n), {"packages": [s["package"] for s in manifest["sequences"]]})
        for name, tau in configs:
            t = time.time()
            losses, slots, retained = sequence_losses(model, seqs, tau)
            rows[name] = {"loss": losses, "slots_per_query": slots, "retained": retained,
                          "seconds": time.time() - t}
            qm.log(f"  {name:14s} mean loss {statistics.fmean(losses):.5f}  ppl {math.exp(statistics.fmean(losses)):.4f}"
                   + (f"  slots/query {statistics.fmean(slots):.0f} of {(n + 1) / 2:.0f}" if slots[0] else ""))
            res.save()
        dense = rows["dense"]["loss"]
        entry = {"sequences": len(dense), "dense": math.exp(statistics.fmean(dense))}
        for name, tau in configs[1:]:
            loss = rows[name]["loss"]
            m, h = rel_diff(loss, dense)
            entry[name] = math.exp(statistics.fmean(loss))
            entry[name + "_rel_diff"] = m
            entry[name + "_rel_diff_ci95"] = h
            entry[name + "_slots_per_query"] = statistics.fmean(rows[name]["slots_per_query"])
        entry["dense_slots_per_query"] = (n + 1) / 2
        summary[str(n)] = entry
        res.save()
    qm.log("done")


if __name__ == "__main__":
    main()

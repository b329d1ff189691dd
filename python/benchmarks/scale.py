"""Scale on one GPU: forward + backward at up to 1M tokens and decode against a 1M-token cache, with
times, peak memory and realized work (issue #35, "Scale").

    python python/benchmarks/scale.py [--seqlens 131072 524288 1048576] [--taus 0 1] [--out scale.json]

Shape: B = 1, Hq = 8, Hkv = 1, d = 128, bf16, causal (the paper's).  Inputs: the benchmark suite's
workloads (lab/suite/workloads.py): "random" (N(0, 1): MALA keeps almost every tile) and
"synthetic" (locality, a sink, needles; --sharpness, default 16).  Each row: forward ms, backward ms
(the backward timed alone after a forward; CUDA events, median of --reps), the peak memory PyTorch
allocates beyond the inputs during a forward + backward, and the realized work (slots/query,
retained fractions; measured in a separate call, since its tile masks are large at 1M tokens).
Decode: one token per sequence (batch 1 and 8) against a cache of the largest N keys: eager and
graph-replayed time, extra memory, slots/query; seeded split-KV, each tau.
"""

import argparse
import json
import os
import sys

import torch

import mala

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "suite"))
from workloads import make_workload  # noqa: E402

from cuda_timer import median_ms  # noqa: E402


def make_inputs(n, hq, hkv, d, regime, sharpness, seed=0):
    """The suite's workloads (lab/suite/workloads.py, mala::make_workload in PyTorch), bf16."""
    q, k, v, _ = make_workload(regime, 1, n, hq, hkv, d, sharpness=sharpness, seed=seed, device="cuda",
                               with_dout=False)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


def train_row(n, tau, regime, args):
    q, k, v = make_inputs(n, args.heads_q, args.heads_kv, args.dim, regime, args.sharpness)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    dout = torch.randn_like(q)
    # Realized work first (the tile masks this needs are large at 1M tokens: 4 GiB forward), then
    # the peak memory of a plain forward + backward, without them.
    out, stats = mala.attention(q, k, v, tau=tau, return_stats=True)
    out.backward(dout)
    summary = {"fwd_slots_per_query": stats.mean_fwd_slots, "bwd_slots_per_query": stats.mean_bwd_slots,
               "fwd_retained": stats.fwd_retained_fraction, "bwd_retained": stats.bwd_retained_fraction,
               "dense_slots_per_query": (n + 1) / 2}
    del out, stats
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = mala.attention(q, k, v, tau=tau)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    fwd = median_ms(lambda: mala.attention(q, k, v, tau=tau), args.reps)
    holder = {}

    def fwd_only():
        holder["o"] = mala.attention(q, k, v, tau=tau)

    def bwd_only():
        holder["o"].backward(dout)

    bwd = median_ms(bwd_only, args.reps, warmup=0, before=fwd_only)
    row = {"n": n, "tau": tau, "regime": regime, "fwd_ms": fwd, "bwd_ms": bwd,
           "peak_gib_beyond_inputs": peak / 2**30,
           "inputs_gib": (q.numel() * 2 + k.numel() * 2 + v.numel() * 2 + dout.numel() * 2) / 2**30,
           "stats": summary}
    del q, k, v, dout, holder
    torch.cuda.empty_cache()
    return row


def decode_row(n, batch, tau, regime, args):
    q_all, k, v = make_inputs(n, args.heads_q, args.heads_kv, args.dim, regime, args.sharpness, seed=1)
    k_cache = k.expand(batch, -1, -1, -1).contiguous() if batch > 1 else k
    v_cache = v.expand(batch, -1, -1, -1).contiguous() if batch > 1 else v
    q = q_all[:, -1:].expand(batch, -1, -1, -1).contiguous()
    del q_all
    lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    out, lse, stats = mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau, return_lse=True,
                                                  return_stats=True)
    summary = {"slots_per_query": stats.mean_fwd_slots, "retained": stats.fwd_retained_fraction,
               "num_splits": stats.num_splits, "dense_slots_per_query": n}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    eager = median_ms(lambda: mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau), args.reps)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau)
    replay = median_ms(graph.replay, args.reps * 5)
    row = {"n": n, "batch": batch, "tau": tau, "regime": regime, "eager_us": eager * 1e3, "graph_us": replay * 1e3,
           "peak_extra_mib": peak / 2**20, "cache_gib": 2 * k_cache.numel() * 2 / 2**30,
           "stats": summary}
    del k_cache, v_cache, q, k, v
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[131072, 524288, 1048576])
    p.add_argument("--taus", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--regimes", nargs="+", default=["random", "synthetic"])
    p.add_argument("--sharpness", type=float, default=16.0, help="synthetic regime's sharpness")
    p.add_argument("--heads-q", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=1)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "total_gib": torch.cuda.get_device_properties(0).total_memory / 2**30, "train": [], "decode": []}
    for n in args.seqlens:
        for regime in args.regimes:
            for tau in args.taus:
                row = train_row(n, tau, regime, args)
                print(json.dumps({k_: row[k_] for k_ in ("n", "tau", "regime", "fwd_ms", "bwd_ms",
                                                              "peak_gib_beyond_inputs")}),
                      row["stats"], flush=True)
                res["train"].append(row)
    n = max(args.seqlens)
    for regime in args.regimes:
        for batch in args.decode_batches:
            for tau in args.taus:
                row = decode_row(n, batch, tau, regime, args)
                print(json.dumps({k_: row[k_] for k_ in ("n", "batch", "tau", "regime", "eager_us", "graph_us",
                                                          "peak_extra_mib")}), row["stats"], flush=True)
                res["decode"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

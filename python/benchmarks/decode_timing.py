"""Decode through the PyTorch binding: eager and CUDA-graph-replayed, for tau = 0, tau = 1 seeded and
tau = 1 per_split, with the realized work and the byte floor (issue #29, "Benchmark").

    python python/benchmarks/decode_timing.py [--seqlens 1024 8192 32768 131072] [--batches 1 8] [--out d.json]
        [--real $S/layer00,$S/layer14] [--num-splits 0 16 33 66]

One new token per sequence (q [B, 1, Hq, d]) against a contiguous cache of N keys per sequence;
Hq = 8, Hkv = 1, d = 128, bf16.  The cache holds the suite's workloads (lab/suite/workloads.py):
"random" (nothing can be skipped) and "synthetic" at --sharpness (default 16), and with --real a real
model's captured K, V and last query row (its own head counts); every sequence of the batch is the
same sequence, the query its last row.  --num-splits times each row at several split counts.  Per row: median microseconds over --reps calls
(CUDA events; eager: one call per timing with the host check off, as the default call runs, and
"(op)" the same call through torch.ops.mala.kvcache, the dispatcher's path; graph: one replay of a
captured call), the split count, the realized slots per query and the retained
fraction (the returned stats), and the byte floor: the K bytes plus the retained V bytes of the
cache, at the device-to-device copy bandwidth measured in the same run (bytes read + written per
second of a 1 GiB copy); and "1-kernel graph", what this timer reads for a graph of one kernel on
one element, replayed right after the row's own replays (the GPU's clocks as warm as the row's): the
launch's share of every graph row, which the floor does not include.  No L2 flush: a 1K-8K cache fits in L2, so the small rows are L2-resident
(as in decoding, where the cache was just written), the 128K rows are not.
"""

import argparse
import json
import os
import sys

import torch

import mala

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "suite"))
from workloads import make_workload  # noqa: E402

from cuda_timer import capture_graph, median_ms  # noqa: E402


def median_us(fn, reps):
    return median_ms(fn, reps) * 1e3


def copy_bandwidth():
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) / s."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * n / (us * 1e-6)


def workload(regime, n, args):
    """(q of the last row [1, 1, Hq, d], k [1, n, Hkv, d], v) for a suite regime, or for 'real:PREFIX'
    (captured states PREFIX_{q,k,v}.npy [N, H, d], lab/real/qwen_measure.py's save step: the first
    n rows, the query row n - 1); None when the capture has fewer than n rows."""
    if regime.startswith("real:"):
        import numpy as np

        prefix = regime[len("real:"):]
        arrays = [np.load(f"{prefix}_{x}.npy", mmap_mode="r") for x in "qkv"]
        if arrays[0].shape[0] < n:
            return None
        q, k, v = (torch.from_numpy(np.array(a[:n])).cuda()[None] for a in arrays)
        return q[:, -1:], k, v
    q_all, k, v, _ = make_workload(regime, 1, n, args.heads_q, args.heads_kv, args.dim,
                                   sharpness=args.sharpness, seed=args.seed, device="cuda", with_dout=False)
    return q_all[:, -1:], k, v


def rows_for(n, batch, regime, args, bw, num_splits=0):
    w = workload(regime, n, args)
    if w is None:
        return []
    q1, k, v = w
    dt = torch.bfloat16
    k_cache = k.to(dt).expand(batch, -1, -1, -1).contiguous()
    v_cache = v.to(dt).expand(batch, -1, -1, -1).contiguous()
    q = q1.to(dt).expand(batch, -1, -1, -1).contiguous()
    del q1, k, v
    lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    kv_bytes = k_cache.numel() * k_cache.element_size()  # K alone; V is the same size
    out = []
    tiny = torch.zeros(1, device="cuda")
    tiny_graph = capture_graph(lambda: tiny.add_(1))
    for tau, rule in ((0.0, "seeded"), (1.0, "seeded"), (1.0, "per_split")):
        def call():
            return mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau, split_rule=rule,
                                               num_splits=num_splits)

        _, _, stats = mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau, split_rule=rule,
                                                  num_splits=num_splits, return_lse=True, return_stats=True)
        retained = stats.fwd_retained_fraction
        def call_op():  # the same call through the dispatcher (torch.ops), as before the direct path
            return torch.ops.mala.kvcache(q, k_cache, v_cache, lens, None, None, None, tau, True, 0.0, num_splits,
                                          False, rule)

        eager = median_us(call, args.reps)
        eager_op = median_us(call_op, args.reps)
        graph = capture_graph(call)
        replay = median_us(graph.replay, args.reps)
        tiny_us = median_us(tiny_graph.replay, args.reps)
        floor = (kv_bytes + retained * kv_bytes) / bw * 1e6
        out.append({"n": n, "batch": batch, "regime": regime, "tau": tau,
                    "split_rule": rule if tau > 0 else None, "num_splits": stats.num_splits,
                    "slots_per_query": stats.mean_fwd_slots, "retained": retained,
                    "eager_us": eager, "eager_op_us": eager_op, "graph_us": replay, "tiny_graph_us": tiny_us, "byte_floor_us": floor,
                    "graph_over_floor": replay / floor})
        del graph
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--regimes", nargs="+", default=["synthetic", "random"])
    p.add_argument("--sharpness", type=float, default=16.0)
    p.add_argument("--heads-q", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=1)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real", type=lambda x: x.split(","), default=[],
                   help="captured states PREFIX[,PREFIX...] (PREFIX_{q,k,v}.npy), timed as regimes 'real:PREFIX'")
    p.add_argument("--num-splits", type=int, nargs="+", default=[0],
                   help="split counts to time (0 = the library's choice)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_gbs": bw / 1e9,
           "heads_q": args.heads_q, "heads_kv": args.heads_kv, "dim": args.dim, "sharpness": args.sharpness,
           "rows": []}
    print(f"{res['device']}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'N':>7} {'B':>2} {'input':>9} {'rule':>14} {'splits':>6} {'slots/q':>9} {'kept':>7} "
          f"{'eager us':>9} {'(op)':>6} {'graph us':>9} {'1-kernel graph':>14} {'floor us':>9} {'graph/floor':>11}")
    for n in args.seqlens:
        for batch in args.batches:
            for regime, splits in [(r, s) for r in args.regimes + [f"real:{x}" for x in args.real]
                                   for s in args.num_splits]:
                for r in rows_for(n, batch, regime, args, bw, splits):
                    res["rows"].append(r)
                    rule = "tau=0" if r["tau"] == 0 else f"tau=1 {r['split_rule']}"
                    print(f"{n:>7} {batch:>2} {os.path.basename(regime):>9} {rule:>14} {r['num_splits']:>6} {r['slots_per_query']:>9.1f} "
                          f"{100 * r['retained']:>6.2f}% {r['eager_us']:>9.1f} {r['eager_op_us']:>6.1f} {r['graph_us']:>9.1f} {r['tiny_graph_us']:>14.1f} "
                          f"{r['byte_floor_us']:>9.1f} {r['graph_over_floor']:>10.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

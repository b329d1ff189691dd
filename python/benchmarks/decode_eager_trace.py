"""Where an eager decode call's time goes, against its CUDA-graph replay (issue #29, "eager within
10 us of the graph-replayed time").

    python python/benchmarks/decode_eager_trace.py [--seqlens 32768 131072] [--batches 1 8] [--reps 30]

For each case (Hq = 8, Hkv = 1, d = 128, bf16, the suite's random cache, tau = 0 and tau = 1 seeded)
it times one call per measurement as decode_timing.py does (CUDA events around the call, synchronized
after it), eagerly and as a graph replay, and traces the same calls with torch.profiler: the median
GPU duration of each kernel in either mode.  An eager call slower than its replay by more than the
host time before its first launch (mala_bench --overhead) has slower kernels, which the trace shows.
"""

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mala

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "suite"))
from workloads import make_workload  # noqa: E402

from cuda_timer import capture_graph, median_ms  # noqa: E402


def kernel_stats(prof):
    """{kernel name (shortened): (count, median GPU microseconds)}."""
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name and "Memcpy" not in e.name:
            name = e.name.split("(")[0].split("<")[0][-40:]
            per.setdefault(name, []).append(e.time_range.elapsed_us())
    return {k: (len(v), statistics.median(v)) for k, v in per.items()}


def run_case(n, batch, tau, args):
    q_all, k, v, _ = make_workload("random", 1, n, 8, 1, 128, sharpness=16.0, seed=0, device="cuda",
                                   with_dout=False)
    dt = torch.bfloat16
    q = q_all[:, -1:].to(dt).expand(batch, -1, -1, -1).contiguous()
    k_cache = k.to(dt).expand(batch, -1, -1, -1).contiguous()
    v_cache = v.to(dt).expand(batch, -1, -1, -1).contiguous()
    lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")

    def call():
        return mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau)

    eager_us = median_ms(call, args.reps) * 1e3
    graph = capture_graph(call)
    graph_us = median_ms(graph.replay, args.reps) * 1e3
    traces = {}
    for mode, fn in (("eager", call), ("graph", graph.replay)):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                fn()
                torch.cuda.synchronize()
        traces[mode] = kernel_stats(prof)
    print(f"N={n:>6} B={batch} tau={tau:g}: eager {eager_us:7.1f} us, graph {graph_us:7.1f} us "
          f"(eager - graph {eager_us - graph_us:6.1f} us)")
    for mode, st in traces.items():
        for name, (cnt, med) in sorted(st.items()):
            print(f"    {mode:5} {name:40} x{cnt:<4} median {med:8.2f} us")
    sys.stdout.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--taus", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for n in args.seqlens:
        for b in args.batches:
            for tau in args.taus:
                run_case(n, b, tau, args)


if __name__ == "__main__":
    main()

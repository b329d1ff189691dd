"""Host time of one eager decode call, layer by layer (issue #29: an eager call within 10 us of the
graph-replayed one).

    python python/benchmarks/decode_host_overhead.py [--n 1024] [--calls 3000]

With a 1K-token cache the kernels take ~10 us, so a loop of calls with one synchronize at the end is
bound by the host: wall time / calls is the host cost per call.  Printed for: an empty torch op
(torch.empty), the operator alone (torch.ops.mala.kvcache), mala.attention_with_kvcache, and the
same under cProfile (the Python-level breakdown).
"""

import argparse
import cProfile
import pstats
import time

import torch

import mala


def per_call_us(fn, calls):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    dt, dev = torch.bfloat16, "cuda"
    q = torch.randn(1, 1, 8, 128, device=dev, dtype=dt)
    kc = torch.randn(1, args.n, 1, 128, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    lens = torch.full((1,), args.n, dtype=torch.int32, device=dev)
    rows = {
        "torch.empty (reference)": lambda: torch.empty(16, device=dev),
        "torch.ops.aten.empty.memory_format": lambda: torch.ops.aten.empty.memory_format([16], device=dev),
        "torch.ops.mala.tile_sizes (no tensors)": lambda: torch.ops.mala.tile_sizes(
            "decode", q.device, q.dtype, 1, 1, args.n, 8, 1, 128, True, 0),
        "torch.ops.mala.kvcache, tau=0": lambda: torch.ops.mala.kvcache(q, kc, vc, lens, None, None, None, 0.0, True,
                                                                       0.0, 0, False, "seeded"),
        "torch.ops.mala.kvcache, tau=1": lambda: torch.ops.mala.kvcache(q, kc, vc, lens, None, None, None, 1.0, True,
                                                                       0.0, 0, False, "seeded"),
        "mala.attention_with_kvcache, tau=1": lambda: mala.attention_with_kvcache(q, kc, vc, lens, tau=1.0),
    }
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn, args.calls):7.1f} us/call (host-bound loop)")
    prof = cProfile.Profile()
    fn = rows["mala.attention_with_kvcache, tau=1"]
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

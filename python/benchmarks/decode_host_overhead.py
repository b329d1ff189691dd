"""Host time of one eager decode call, layer by layer (issue #29: an eager call within 10 us of the
graph-replayed one).

    python python/benchmarks/decode_host_overhead.py [--n 1024] [--calls 3000]

Host time per call: calls are timed in bursts of --burst without synchronizing inside a burst (a
burst's kernels fit the launch queue, so the host never waits for the GPU, whether the kernels are
shorter or longer than the host's work), synchronizing between bursts; the median burst.  Printed
for: an empty torch op (torch.empty), the operator alone (torch.ops.mala.kvcache; at 128 keys the
call is one key tile, one split, so one kernel and no split-KV scratch: the difference to the
default row is the combine's launch and the scratch), the eager entry point without the dispatcher
(mala._C.kvcache_direct, what mala.attention_with_kvcache calls in eager mode),
mala.attention_with_kvcache, and the same under cProfile (the Python-level breakdown).
"""

import argparse
import cProfile
import pstats
import time

import torch

import mala


def per_call_us(fn, calls, burst):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, calls // burst)):
        t = time.perf_counter()
        for _ in range(burst):
            fn()
        times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] / burst * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--burst", type=int, default=100, help="calls per timed burst (at most 2 kernels each)")
    args = p.parse_args()
    dt, dev = torch.bfloat16, "cuda"
    q = torch.randn(1, 1, 8, 128, device=dev, dtype=dt)
    kc = torch.randn(1, args.n, 1, 128, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    lens = torch.full((1,), args.n, dtype=torch.int32, device=dev)
    kc1, vc1 = kc[:, :128].contiguous(), vc[:, :128].contiguous()
    lens1 = torch.full((1,), 128, dtype=torch.int32, device=dev)
    rows = {
        "torch.empty (reference)": lambda: torch.empty(16, device=dev),
        "torch.ops.aten.empty.memory_format": lambda: torch.ops.aten.empty.memory_format([16], device=dev),
        "torch.ops.mala.tile_sizes (no tensors)": lambda: torch.ops.mala.tile_sizes(
            "decode", q.device, q.dtype, 1, 1, args.n, 8, 1, 128, True, 0),
        "torch.ops.mala.kvcache, tau=0": lambda: torch.ops.mala.kvcache(q, kc, vc, lens, None, None, None, 0.0, True,
                                                                       0.0, 0, False, "seeded"),
        "torch.ops.mala.kvcache, tau=1": lambda: torch.ops.mala.kvcache(q, kc, vc, lens, None, None, None, 1.0, True,
                                                                       0.0, 0, False, "seeded"),
        "torch.ops.mala.kvcache, tau=1, 128 keys": lambda: torch.ops.mala.kvcache(
            q, kc1, vc1, lens1, None, None, None, 1.0, True, 0.0, 0, False, "seeded"),
        "mala._C.kvcache_direct, tau=1": lambda: mala._C.kvcache_direct(q, kc, vc, lens, None, None, None, 1.0, True,
                                                                       0.0, 0, "seeded", False),
        "mala.attention_with_kvcache, tau=1": lambda: mala.attention_with_kvcache(q, kc, vc, lens, tau=1.0),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: batch 1, Hq=8, Hkv=1, d=128, bf16, "
          f"cache N={args.n}; host time per call, median of bursts of {args.burst}")
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn, args.calls, args.burst):7.1f} us/call")
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

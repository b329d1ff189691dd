"""Timing and peak memory of one operator call (docs/benchmarks.md "Protocol").

Every timed call is bracketed by its own pair of CUDA events; before each one a 256 MiB buffer is
zeroed so that no input sits in L2 (inputs are not rotated; the flush does the same job for every
size).  Warm-up first (its first call, which includes compilation/autotuning, is timed separately
on the host), then at least `min_reps` timed calls; the median is reported with min, p20, p80.
Peak memory: torch.cuda.reset_peak_memory_stats() before one extra call, max_memory_allocated()
after it; reported as the absolute peak and as the increase over what was allocated before.
"""

from __future__ import annotations

import statistics
import time

import torch

_FLUSH = {}


def _flush_buffer(device):
    if device not in _FLUSH:
        _FLUSH[device] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return _FLUSH[device]


DEVICE = "cuda"  # "cpu" only for smoke tests of the suite itself (host timer, no memory counters)


def measure(fn, *, device=None, min_reps=20, max_reps=100, target_s=1.0, warmup=2,
            setup=None):
    """Median latency (ms) of fn() and its peak memory.  setup(), if given, runs before each call,
    untimed (e.g. to rebuild an autograd graph)."""
    device = device or DEVICE
    if device == "cpu":
        return _measure_cpu(fn, min_reps=min_reps, setup=setup)
    flush = _flush_buffer(device)
    t0 = time.perf_counter()
    if setup:
        setup()
    fn()
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    est = None
    for _ in range(max(warmup - 1, 1)):
        if setup:
            setup()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        est = s.elapsed_time(e)
    reps = int(min(max_reps, max(min_reps, target_s * 1e3 / max(est, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if setup:
            setup()
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    # peak memory over one more call
    if setup:
        setup()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    q = lambda f: times[min(len(times) - 1, int(f * (len(times) - 1) + 0.5))]  # noqa: E731
    return {
        "ms": statistics.median(times),
        "ms_min": times[0],
        "ms_p20": q(0.2),
        "ms_p80": q(0.8),
        "reps": reps,
        "first_call_s": first_call_s,
        "peak_bytes": int(peak),
        "peak_extra_bytes": int(peak - before),
    }


def _measure_cpu(fn, min_reps, setup=None):
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(min_reps):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"ms": statistics.median(times), "ms_min": times[0], "ms_p20": times[len(times) // 5],
            "ms_p80": times[(4 * len(times)) // 5], "reps": min_reps, "first_call_s": first,
            "peak_bytes": None, "peak_extra_bytes": None}


def sync():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def empty_cache():
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def causal_flops_fwd(batch, seqlen_q, seqlen_k, heads_q, head_dim, causal=True):
    """4 * Nq * Nk_visible_avg * d * Hq * B (docs/benchmarks.md), bottom-right causal."""
    if causal:
        vis = [min(max(i + seqlen_k - seqlen_q + 1, 0), seqlen_k) for i in (0, seqlen_q - 1)]
        avg = (vis[0] + vis[1]) / 2.0  # visible counts grow by one per row
    else:
        avg = seqlen_k
    return 4.0 * seqlen_q * avg * head_dim * heads_q * batch

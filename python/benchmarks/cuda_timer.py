"""python/benchmarks' timer (lab/suite/timing.py is the suite's own): CUDA events around one call,
the median over repetitions; and the CUDA-graph capture the decode scripts replay."""

import torch


def median_ms(fn, reps=10, warmup=1, before=None):
    """Median milliseconds of fn() over `reps` timed calls (CUDA events, synchronized each call),
    after `warmup` untimed calls; `before()`, if given, runs untimed before each timed call (a
    forward before its timed backward)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def capture_graph(fn):
    """A CUDA graph of one fn() call, captured after a warm-up call on a side stream (as PyTorch asks)."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return graph

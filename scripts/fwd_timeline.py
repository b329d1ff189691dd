#!/usr/bin/env python3
"""Phase timeline of the warp-specialized forward, from a build with -DMALA_FWD_TIMELINE.

Usage: mala_bench --op fwd --n 32K --regime random --tau 0,1 --iters 10 > log; scripts/fwd_timeline.py log

The diagnostic build prints, for the sixth launch of each instance (dense / tau > 0), the SM clock
of warp 0 of each consumer warpgroup of one CTA at the phase boundaries of 64 key tiles (lines
"TL dense wgG iI e0 .. e8", events in the order of FwdTimelineEvent in fwd_kernel_sm90_ws.cuh).
This prints, per instance and warpgroup, the median time per tile and the median clock of each
event of tile t and of the next tile t - 1, relative to the start of finish(t).
"""
import collections
import statistics
import sys

EVENTS = ["decide start", "decide end", "finish start", "P V committed", "P V done", "S issued", "test done",
          "quad max done", "K ready"]


def wrap(x):
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


def main(path):
    rows = collections.defaultdict(dict)
    for line in open(path):
        f = line.split()
        if len(f) != 13 or f[0] != "TL":
            continue
        rows[(int(f[1]), int(f[2][2:]))][int(f[3][1:])] = [int(x) for x in f[4:]]
    if not rows:
        sys.exit("no TL lines: was the benchmark built with -DMALA_FWD_TIMELINE?")
    for (dense, wg), r in sorted(rows.items(), reverse=True):
        tiles = sorted(r, reverse=True)  # processing order: key tiles from the diagonal down
        fin = EVENTS.index("finish start")
        period = statistics.median(wrap(r[b][fin] - r[a][fin]) for a, b in zip(tiles, tiles[1:]))
        print(f"{'dense' if dense else 'tau > 0'} instance, warpgroup {wg}: {period:.0f} cycles per key tile")
        rel = collections.defaultdict(list)
        for i in tiles[4:-4]:  # steady state
            if i - 1 not in r:
                continue
            for which, tile in (("t", i), ("t - 1", i - 1)):
                for e, name in enumerate(EVENTS):
                    if r[tile][e]:
                        rel[f"{name} ({which})"].append(wrap(r[tile][e] - r[i][fin]))
        for name, v in sorted(rel.items(), key=lambda kv: statistics.median(kv[1])):
            m = statistics.median(v)
            if -5000 < m < 5000:
                print(f"    {name:28s} {m:7.0f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/stdin")

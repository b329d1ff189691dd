#!/usr/bin/env python3
"""Tables of the real regime from mala_bench logs (--real) and real_stats.py JSON files.

  python3 lab/real/summarize.py bench/results/real/mala_bench_real_h100.log \
      --stats gpl3=real-data/gpl3/stats.json --stats paper=real-data/paper/stats.json

The log is a concatenation of `mala_bench --op fwd --real ...` and `--op bwd --real ...` outputs,
each batch preceded by a line `### <text> batch ...`.  Prints, per text, one Markdown row per layer
(GPU: realized slots/query, retained tiles, time at tau = 1 and tau = 0, ratio; CPU stats: omitted
mass and O error) and the sums over layers (the model's attention time at each tau).
"""
import argparse
import json
import re
from collections import defaultdict


def parse_log(path):
    data = defaultdict(lambda: defaultdict(dict))  # text -> layer -> {fwd0, fwd1, bwd0, bwd1}
    text = None
    op = None
    layer = None
    for line in open(path):
        m = re.match(r"### (\S+) batch", line)
        if m:
            text = m.group(1)
            continue
        if line.startswith("== forward"):
            op = "fwd"
        elif line.startswith("== backward"):
            op = "bwd"
        m = re.search(r"real input \S*layer(\d+): N=(\d+)", line)
        if m:
            layer = int(m.group(1))
            data[text][layer]["n"] = int(m.group(2))
            continue
        f = line.split()
        if op == "fwd" and len(f) == 12 and f[1] == "real":
            tau = float(f[3])
            data[text][layer][f"fwd{int(tau > 0)}"] = {
                "ms": float(f[5]), "slots": float(f[8]), "retained": float(f[9]) / 100,
                "omit_mean": float(f[10]), "omit_max": float(f[11])}
        elif op == "bwd" and len(f) == 9 and f[0] == "real":
            tau = float(f[3])
            data[text][layer][f"bwd{int(tau > 0)}"] = {
                "ms": float(f[4]), "slots": float(f[6]), "retained": float(f[7].rstrip("%")) / 100}
    return data


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--stats", action="append", default=[], help="TEXT=stats.json (real_stats.py --json)")
    a = ap.parse_args()
    data = parse_log(a.log)
    stats = {}
    for s in a.stats:
        name, path = s.split("=", 1)
        j = json.load(open(path))
        stats[name] = {r["layer"]: r for r in j["layers"]}
    for text, layers in data.items():
        st = stats.get(text, {})
        n = next(iter(layers.values()))["n"]
        print(f"\n{text}: N = {n}, tau = 1 (GPU slots/retained from the kernels' own counters; omitted mass "
              f"and O error from the CPU implementation)\n")
        print("| layer | fwd slots/q | fwd retained | fwd tau=1 / tau=0 ms | fwd speedup | bwd slots/q | "
              "bwd retained | bwd tau=1 / tau=0 ms | bwd speedup | omitted mass mean / max | O rel. L2 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        tot = defaultdict(float)
        for L in sorted(layers):
            r = layers[L]
            f0, f1, b0, b1 = r["fwd0"], r["fwd1"], r["bwd0"], r["bwd1"]
            for k, v in (("f0", f0["ms"]), ("f1", f1["ms"]), ("b0", b0["ms"]), ("b1", b1["ms"])):
                tot[k] += v
            tot["fs"] += f1["slots"]
            tot["fr"] += f1["retained"]
            tot["bs"] += b1["slots"]
            tot["br"] += b1["retained"]
            c = st.get(L)
            cpu = f"{c['omitted_mean']:.1e} / {c['omitted_max']:.1e} | {c['o_rel_l2']:.1e}" if c else "- | -"
            print(f"| {L} | {f1['slots']:.0f} | {100 * f1['retained']:.1f}% | {f1['ms']:.3f} / {f0['ms']:.3f} | "
                  f"{f0['ms'] / f1['ms']:.2f}x | {b1['slots']:.0f} | {100 * b1['retained']:.1f}% | "
                  f"{b1['ms']:.3f} / {b0['ms']:.3f} | {b0['ms'] / b1['ms']:.2f}x | {cpu} |")
        k = len(layers)
        worst = ""
        if st:
            worst = (f"{max(c['omitted_mean'] for c in st.values()):.1e} / {max(c['omitted_max'] for c in st.values()):.1e}"
                     f" | {max(c['o_rel_l2'] for c in st.values()):.1e}")
        print(f"| all {k} | {tot['fs'] / k:.0f} (mean) | {100 * tot['fr'] / k:.1f}% | {tot['f1']:.2f} / {tot['f0']:.2f} "
              f"(sum) | {tot['f0'] / tot['f1']:.2f}x | {tot['bs'] / k:.0f} | {100 * tot['br'] / k:.1f}% | "
              f"{tot['b1']:.2f} / {tot['b0']:.2f} | {tot['b0'] / tot['b1']:.2f}x | {worst or '- | -'} (worst) |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Issue 67's table from suite results: one row per (op, N, d, heads, MALA tau) with MALA's time
beside FlashAttention-4's and cuDNN's from the same run (the same section, shape and inputs).

    python3 lab/suite/kernels_vs_fa4.py OUT/results.json [...] --out bench/results/kernels_vs_fa4.json

Rows: {"op", "N", "d", "heads" ("Hq/Hkv"), "tau", "input", "mala_ms", "fa4_ms", "cudnn_ms",
"vs_fa4", "vs_cudnn" (the baseline's time over MALA's: above 1 is MALA faster), "fwd_slots",
"bwd_slots", "retained_fwd", "retained_bwd" (MALA's realized work, where the run recorded it),
"device", "section"}.  A baseline that did not run (unavailable, flagged or failed) is null, with its
status in "fa4_status" / "cudnn_status".  Only records with status "ok" give times.
"""

from __future__ import annotations

import argparse
import json
import os

SHAPE_KEYS = ("section", "op", "regime", "sharpness", "B", "N", "Hq", "Hkv", "d")


def _key(r):
    return tuple(r.get(k) for k in SHAPE_KEYS)


def _ms(r):
    return r["ms"] if r is not None and r.get("status") == "ok" else None


def rows(data, sections=("fa4", "primary", "secondary")):
    """The table's rows from one results.json document (records of the given sections)."""
    recs = [r for r in data.get("records", []) if r.get("section") in sections and r.get("op") in ("fwd", "bwd")]
    by_shape = {}
    for r in recs:
        by_shape.setdefault(_key(r), {})[r["system"]] = r
    device = data.get("meta", {}).get("device")
    out = []
    def order(kv):
        s = dict(zip(SHAPE_KEYS, kv[0]))
        return (s["section"], s["op"], s["d"], -s["Hq"], s["Hkv"], s["regime"], s["sharpness"], s["B"], s["N"])

    for key, systems in sorted(by_shape.items(), key=order):
        shape = dict(zip(SHAPE_KEYS, key))
        fa4, cudnn = systems.get("fa4"), systems.get("sdpa_cudnn")
        for name, m in sorted(systems.items()):
            if not name.startswith("mala_tau") or m.get("status") != "ok":
                continue
            mala_ms, fa4_ms, cudnn_ms = m["ms"], _ms(fa4), _ms(cudnn)
            row = {"op": shape["op"], "N": shape["N"], "d": shape["d"], "heads": f"{shape['Hq']}/{shape['Hkv']}",
                   "tau": m.get("tau"), "input": shape["regime"], "mala_ms": mala_ms, "fa4_ms": fa4_ms,
                   "cudnn_ms": cudnn_ms, "vs_fa4": fa4_ms / mala_ms if fa4_ms else None,
                   "vs_cudnn": cudnn_ms / mala_ms if cudnn_ms else None,
                   "fwd_slots": m.get("fwd_slots_mean"), "bwd_slots": m.get("bwd_slots_mean"),
                   "retained_fwd": m.get("fwd_retained_fraction"), "retained_bwd": m.get("bwd_retained_fraction"),
                   "device": device, "section": shape["section"]}
            if fa4_ms is None:
                row["fa4_status"] = fa4.get("status") if fa4 is not None else "not run"
            if cudnn_ms is None:
                row["cudnn_status"] = cudnn.get("status") if cudnn is not None else "not run"
            out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="suite results.json files")
    ap.add_argument("--sections", default="fa4,primary,secondary")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    table = []
    for p in a.results:
        with open(p) as f:
            table += rows(json.load(f), tuple(a.sections.split(",")))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(table, f, indent=1)
    for r in table:
        fa4 = f"{r['vs_fa4']:.2f}x FA4" if r["vs_fa4"] else f"FA4 {r.get('fa4_status')}"
        cud = f"{r['vs_cudnn']:.2f}x cuDNN" if r["vs_cudnn"] else f"cuDNN {r.get('cudnn_status')}"
        print(f"{r['op']:3s} N={r['N']:>6} d={r['d']:>3} {r['heads']:>4} tau={r['tau']:g} {r['input']}: "
              f"MALA {r['mala_ms']:.3f} ms, {fa4}, {cud}")
    print(f"kernels_vs_fa4: {len(table)} rows -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

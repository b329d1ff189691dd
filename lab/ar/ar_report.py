"""Tables (markdown) and the accuracy-against-length plot of the associative-recall study, from the
summary that `ar_train.py collect` writes.

  python3 lab/ar/ar_report.py ar.json [--plot ar_accuracy.png]

Prints, per d_model, accuracy with its 95% interval per (method, length), then realized mean slots
and step time per method.  A cell whose training stopped at the time cap (fewer steps than the
others: not step-matched) is marked with * and listed under its table.  The plot (one panel per
d_model, accuracy against length per method) needs matplotlib and is skipped with a note without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ar_methods import METHODS  # noqa: E402


def _pct(x):
    return "-" if x is None else f"{100 * x:.2f}%"


def tables(doc) -> str:
    cells = doc["cells"]
    lines = []
    for d in sorted({c["d_model"] for c in cells}):
        lens = sorted({c["seqlen"] for c in cells if c["d_model"] == d})
        early = []
        by = {(c["method"], c["seqlen"]): c for c in cells if c["d_model"] == d}
        lines += [f"d_model {d}: accuracy [95% interval] (seeds)", "",
                  "| method | " + " | ".join(f"{n:,}" for n in lens) + " |",
                  "|---|" + "---|" * len(lens)]
        for m in METHODS:
            row = []
            for n in lens:
                c = by.get((m, n))
                if c is None:
                    row.append("")
                elif c.get("accuracy") is None:
                    row.append("skipped")
                else:
                    lo, hi = c["ci95"]
                    mark = " *" if c.get("hit_time_cap") else ""
                    row.append(f"{_pct(c['accuracy'])} [{_pct(lo)}, {_pct(hi)}] ({len(c['seeds'])}){mark}")
                    if mark:
                        early.append(f"{m} at {n:,}: steps {c['steps_done']} of {c['steps']}")
            if any(row):
                lines.append(f"| {m} | " + " | ".join(row) + " |")
        if early:
            lines += ["", "\\* stopped at the time cap, not step-matched: " + "; ".join(early)]
        lines += ["", f"d_model {d}: mean slots per query / step ms", "",
                  "| method | " + " | ".join(f"{n:,}" for n in lens) + " |", "|---|" + "---|" * len(lens)]
        for m in METHODS:
            row = []
            for n in lens:
                c = by.get((m, n))
                ok = c is not None and c.get("mean_slots") is not None
                ms = "-" if ok and c.get("step_ms") is None else f"{c['step_ms']:.0f}" if ok else ""
                row.append(f"{c['mean_slots']:.0f} / {ms}" if ok else "")
            if any(row):
                lines.append(f"| {m} | " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(doc, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ar_report: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    cells = [c for c in doc["cells"] if c.get("accuracy") is not None]
    ds = sorted({c["d_model"] for c in cells})
    fig, axes = plt.subplots(1, max(1, len(ds)), figsize=(4 * max(1, len(ds)), 3.2), squeeze=False)
    for ax, d in zip(axes[0], ds):
        for m in METHODS:
            pts = sorted((c["seqlen"], c["accuracy"], c["ci95"]) for c in cells if c["d_model"] == d and c["method"] == m)
            if pts:
                x = [p[0] for p in pts]
                y = [100 * p[1] for p in pts]
                err = [[100 * (p[1] - p[2][0]) for p in pts], [100 * (p[2][1] - p[1]) for p in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d_model {d}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summary")
    ap.add_argument("--plot", default="")
    args = ap.parse_args(argv)
    with open(args.summary) as f:
        doc = json.load(f)
    print(tables(doc))
    if args.plot:
        plot(doc, args.plot)


if __name__ == "__main__":
    main()

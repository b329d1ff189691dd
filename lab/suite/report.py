"""Tables of one or more results.json files, and the update of docs/benchmarks.md.

    python3 lab/suite/report.py RESULTS.json [MORE.json ...] [--doc docs/benchmarks.md]
            [--plots-from DIR --plots-to lab/suite/results]

Prints the Markdown tables.  With --doc, replaces the part of the document between the markers
<!-- results:begin --> and <!-- results:end --> with them (and the plots list).  Only measured
records appear; a system that could not run a shape shows its status (OOM, failed, unsupported,
unavailable, skipped) and the reason is listed under the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
OPNAME = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward+backward", "decode": "decode"}


def _k(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _cell(r, unit="ms"):
    if r is None:
        return "—"
    if r.get("status") != "ok":
        return r.get("status", "?").upper()
    v = r["ms"] * (1000 if unit == "us" else 1)
    s = f"{v:.3g}" if v < 100 else f"{v:.0f}"
    if r.get("flagged"):
        s += " ⚑"
    return s


def _work(r, with_bwd=True):
    """MALA realized work: slots fwd/bwd, retained fwd/bwd, omitted max."""
    if r is None or r.get("fwd_slots_mean") is None:
        if r is not None and r.get("omitted_mass_max") is not None:
            return f"omitted max {r['omitted_mass_max']:.1e}"
        return ""
    s = f"{r['fwd_slots_mean']:.0f}"
    if with_bwd and r.get("bwd_slots_mean") is not None:
        s += f" / {r['bwd_slots_mean']:.0f}"
    s += f" slots; {100 * r['fwd_retained_fraction']:.1f}%"
    if with_bwd and r.get("bwd_retained_fraction") is not None:
        s += f" / {100 * r['bwd_retained_fraction']:.1f}%"
    if r.get("omitted_mass_max") is not None:
        s += f"; omitted mean {r['omitted_mass_mean']:.1e} max {r['omitted_mass_max']:.1e}"
    return s


def _systems(recs):
    """(system, label) in order of appearance, leaving out systems that were unavailable throughout
    (they are listed once under the tables with the reason)."""
    names = []
    for r in recs:
        if (r["system"], r["label"]) not in names:
            names.append((r["system"], r["label"]))
    return [(n, lab) for n, lab in names
            if any(r["system"] == n and r.get("status") != "unavailable" for r in recs)]


def _find(recs, **kw):
    for r in recs:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _reasons(recs):
    seen, out = set(), []
    for r in recs:
        if r.get("status") not in ("ok", None):
            key = (r["system"], r["status"], r.get("reason", "")[:160])
            if key in seen:
                continue
            seen.add(key)
            out.append(f"- {r['label']}, {r['section']} {r['op']} N={_k(r['N'])}"
                       f" (Hq={r['Hq']} Hkv={r['Hkv']} d={r['d']}, B={r['B']}): "
                       f"{r['status']}: {r.get('reason', '')[:300]}")
        if r.get("flagged"):
            key = (r["system"], "flag", r.get("flag_reason", "")[:160])
            if key not in seen:
                seen.add(key)
                out.append(f"- ⚑ {r['label']}: {r.get('flag_reason', '')}")
    return out


def training_tables(data, section, shapes):
    recs = [r for r in data["records"] if r["section"] == section]
    lines = []
    for (Hq, Hkv, d) in shapes:
        rs = [r for r in recs if (r["Hq"], r["Hkv"], r["d"]) == (Hq, Hkv, d)]
        if not rs:
            continue
        systems = _systems(rs)
        mala_names = [n for n, _ in systems if n.startswith("mala_tau") and n != "mala_tau0"]
        ns = sorted({r["N"] for r in rs})
        lines.append(f"\n**{section}: Hq={Hq} Hkv={Hkv} d={d}, bf16 causal, batch 1, random inputs; "
                     f"median ms (⚑ = flagged by the correctness guard)**\n")
        head = ["N", "op"] + [lab for _, lab in systems] + \
               [f"{n.replace('mala_tau', 'MALA τ=')} slots/query fwd / bwd; retained fwd / bwd; omitted mass"
                for n in mala_names]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for n in ns:
            for op in ("fwd", "bwd", "fwd_bwd"):
                row = [_k(n), OPNAME[op]]
                any_ = False
                for name, _ in systems:
                    r = _find(rs, N=n, op=op, system=name)
                    any_ |= r is not None
                    row.append(_cell(r))
                if not any_:
                    continue
                for name in mala_names:
                    row.append(_work(_find(rs, N=n, op=op, system=name)))
                lines.append("| " + " | ".join(row) + " |")
        fsa = [n for n, _ in systems if n.startswith("fsa_tau") and n != "fsa_tau0"]
        for name in fsa:
            om = [(r["N"], r.get("omitted_mass_max")) for r in rs if r["system"] == name and r["op"] == "fwd"
                  and r.get("omitted_mass_max") is not None]
            if om:
                lines.append(f"\n{name}: forward omitted mass max per N: " +
                             ", ".join(f"{_k(n)} {m:.1e}" for n, m in om))
        dense_tf = []
        for name, lab in systems:
            if name.startswith(("sdpa", "flex")):
                tf = [(r["N"], r["tflops_dense_equiv"]) for r in rs if r["system"] == name and r["op"] == "fwd"
                      and r.get("status") == "ok"]
                if tf:
                    dense_tf.append(f"{lab}: " + ", ".join(f"{_k(n)} {t:.0f}" for n, t in tf))
        if dense_tf:
            lines.append("\nForward TFLOP/s (causal count): " + "; ".join(dense_tf))
        mem = []
        for name, lab in systems:
            pk = [(r["N"], r["peak_bytes"]) for r in rs if r["system"] == name and r["op"] == "fwd_bwd"
                  and r.get("status") == "ok" and r.get("peak_bytes") is not None]
            if pk:
                mem.append(f"{lab} " + ", ".join(f"{_k(n)} {b / 2**30:.2f}" for n, b in pk))
        if mem:
            lines.append("\nPeak allocated GiB over one forward+backward: " + "; ".join(mem))
    return lines


def decode_tables(data):
    rs = [r for r in data["records"] if r["section"] == "decode"]
    if not rs:
        return []
    systems = _systems(rs)
    mala_names = [n for n, _ in systems if n.startswith("mala_tau") and n != "mala_tau0"]
    lines = ["\n**decode: 1 token, Hq=8 Hkv=1 d=128 bf16, median µs**\n"]
    head = ["B", "input", "N"] + [lab for _, lab in systems] + \
           [f"{n.replace('mala_tau', 'MALA τ=')} slots; retained; omitted" for n in mala_names]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for B in sorted({r["B"] for r in rs}):
        for regime, sharp in sorted({(r["regime"], r["sharpness"]) for r in rs}):
            for n in sorted({r["N"] for r in rs}):
                row = [str(B), regime + (f" s={sharp:g}" if sharp else ""), _k(n)]
                got = False
                for name, _ in systems:
                    r = _find(rs, B=B, regime=regime, sharpness=sharp, N=n, system=name)
                    got |= r is not None
                    row.append(_cell(r, "us"))
                if not got:
                    continue
                for name in mala_names:
                    row.append(_work(_find(rs, B=B, regime=regime, sharpness=sharp, N=n, system=name), False))
                lines.append("| " + " | ".join(row) + " |")
    return lines


def sweep_tables(data):
    rs = [r for r in data["records"] if r["section"] == "sweep"]
    if not rs:
        return []
    lines = []
    for n in sorted({r["N"] for r in rs}):
        for op in ("fwd", "bwd", "fwd_bwd"):
            ro = [r for r in rs if r["N"] == n and r["op"] == op]
            if not ro:
                continue
            systems = _systems(ro)
            lines.append(f"\n**sweep: synthetic inputs, N={_k(n)}, {OPNAME[op]}, Hq=8 Hkv=1 d=128; "
                         f"median ms and speedup over the fastest dense system on the same input**\n")
            head = ["sharpness", "MALA retained (fwd / bwd)", "MALA slots (fwd / bwd)", "omitted max"] + \
                   [lab for _, lab in systems] + ["speedups"]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            for sharp in sorted({r["sharpness"] for r in ro}):
                rr = [r for r in ro if r["sharpness"] == sharp]
                m = next((r for r in rr if r["system"].startswith("mala") and r.get("fwd_retained_fraction")
                          is not None), None)
                rule = next((r.get("rule_retained_fraction") for r in rr
                             if r.get("rule_retained_fraction") is not None), None)
                if m:
                    ret = f"{100 * m['fwd_retained_fraction']:.1f}%"
                    if m.get("bwd_retained_fraction") is not None:
                        ret += f" / {100 * m['bwd_retained_fraction']:.1f}%"
                    slots = f"{m['fwd_slots_mean']:.0f}"
                    if m.get("bwd_slots_mean") is not None:
                        slots += f" / {m['bwd_slots_mean']:.0f}"
                    om = f"{m['omitted_mass_max']:.1e}" if m.get("omitted_mass_max") is not None else ""
                else:
                    ret = f"rule model {100 * rule:.1f}%" if rule is not None else "—"
                    slots, om = "—", ""
                row = [f"{sharp:g}", ret, slots, om]
                for name, _ in systems:
                    row.append(_cell(_find(rr, system=name)))
                dense = [r["ms"] for r in rr if r["tau"] is None and r.get("status") == "ok"]
                sp = []
                if dense:
                    for r in rr:
                        if r["tau"] is not None and r.get("status") == "ok":
                            sp.append(f"{r['label']} {min(dense) / r['ms']:.2f}×")
                row.append("; ".join(sp))
                lines.append("| " + " | ".join(row) + " |")
    return lines


def dist_tables(data):
    rs = [r for r in data["records"] if r["section"] == "dist"]
    if not rs:
        return []
    W = rs[0].get("world_size")
    systems = _systems(rs)
    r0 = rs[0]
    hq_t, hkv_t = r0.get("heads_q_total", 64), r0.get("heads_kv_total", 8)
    inputs = "random" if r0.get("regime") == "random" else f"synthetic s={r0.get('sharpness', 0):g}"
    lines = [f"\n**tensor parallel over {W} GPUs ({hq_t} query / {hkv_t} KV heads split; each rank Hq={r0['Hq']} "
             f"Hkv={r0['Hkv']}; {inputs} inputs): synchronized group latency, median ms of the max over ranks**\n"]
    head = ["N", "op"] + [lab for _, lab in systems] + ["peak GiB per rank (max)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for n in sorted({r["N"] for r in rs}):
        for op in ("fwd", "bwd", "fwd_bwd", "decode"):
            rr = [r for r in rs if r["N"] == n and r["op"] == op]
            if not rr:
                continue
            row = [_k(n), OPNAME[op]] + [_cell(_find(rr, system=s)) for s, _ in systems]
            peaks = [f"{lab} {r['peak_bytes_max_rank'] / 2**30:.2f}" for s, lab in systems
                     for r in [_find(rr, system=s)] if r and r.get("status") == "ok"
                     and r.get("peak_bytes_max_rank") is not None]
            row.append("; ".join(peaks))
            lines.append("| " + " | ".join(row) + " |")
    return lines


def checks_table(data):
    cs = data.get("checks", [])
    if not cs:
        return []
    lines = ["\n**correctness guard (bf16 inputs against an fp32 reference; rel. L2 error)**\n",
             "| system | input | shape | O | dQ | dK | dV | omitted max | flag |", "|---|---|---|---|---|---|---|---|---|"]
    unavailable = {}
    for c in cs:
        if c.get("status") == "unavailable":
            unavailable.setdefault(c["label"], c.get("reason", ""))
            continue
        shape = f"{c.get('op', 'train')} B={c['B']} N={c['N']} Hq={c['Hq']} Hkv={c['Hkv']} d={c['d']}"
        inp = c["regime"] + (f" s={c['sharpness']:g}" if c.get("sharpness") else "")
        if c.get("status") != "ok":
            lines.append(f"| {c['label']} | {inp} | {shape} | {c.get('status', '?').upper()}: "
                         f"{c.get('reason', '')[:120]} | | | | | |")
            continue
        f = lambda k: f"{c[k]:.1e}" if c.get(k) is not None else ""  # noqa: E731
        lines.append(f"| {c['label']} | {inp} | {shape} | {f('rel_l2_o')} | {f('rel_l2_dq')} | {f('rel_l2_dk')} | "
                     f"{f('rel_l2_dv')} | {f('omitted_mass_max')} | {('⚑ ' + c['flag_reason']) if c.get('flagged') else 'ok'} |")
    for lab, why in unavailable.items():
        lines.append(f"\n{lab}: unavailable ({why[:200]})")
    return lines


def header(data):
    m = data["meta"]
    return (f"Device: {m.get('device')} ({m.get('device_count', '?')} visible), driver {m.get('driver')}, "
            f"torch {m.get('torch')}, CUDA {m.get('cuda_runtime')}, cuDNN {m.get('cudnn')}, "
            f"triton {m.get('triton')}; flash-sparse-attn {((m.get('flash_sparse_attn') or {}).get('version'))}; "
            f"mala {((m.get('mala') or {}).get('version') or (m.get('mala') or {}).get('error'))}; "
            f"git commit {m.get('git_commit')}"
            f"{' + uncommitted changes' if str(m.get('git_dirty')) in ('1', 'true', 'yes') else ''}; "
            f"run {m.get('time_utc')} ({m.get('mode')}, "
            f"{m.get('wall_s', 0):.0f} s).")


def summary_markdown(datas):
    out = []
    for data in datas:
        out.append(header(data))
        out += checks_table(data)
        out += training_tables(data, "primary", [(8, 1, 128)])
        out += decode_tables(data)
        out += sweep_tables(data)
        out += training_tables(data, "secondary", [(8, 1, 64), (8, 8, 128)])
        out += training_tables(data, "fa4", [(8, 1, 128), (12, 2, 128), (8, 1, 64), (8, 1, 256)])
        out += dist_tables(data)
        rs = _reasons(data["records"])
        if rs:
            out.append("\nNot measured / flagged:\n")
            out += rs
        for n in data.get("notes", []):
            out.append(f"\nNote: {n}")
        out.append("")
    return "\n".join(out) + "\n"


def summary_text(data):
    return "\n==== summary ====\n" + summary_markdown([data])


def update_doc(doc, datas, plots, title=None):
    with open(doc) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: markers {BEGIN} / {END} not found")
    body = summary_markdown(datas)
    if plots:
        body = "\n".join(f"![{os.path.splitext(os.path.basename(p))[0]}]({p})" for p in plots) + "\n\n" + body
    if title:
        body = f"**{title}**\n\n" + body
    pre, rest = text.split(BEGIN, 1)
    _, post = rest.split(END, 1)
    with open(doc, "w") as f:
        f.write(pre + BEGIN + "\n" + body + END + post)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--doc")
    ap.add_argument("--plots-from", action="append", default=[],
                    help="a run's output folder (repeatable, one per results.json)")
    ap.add_argument("--plots-to", default="lab/suite/results")
    ap.add_argument("--title", help="a line above the tables (what run this is)")
    ap.add_argument("--plot", action="append", default=[],
                    help="a plot already in the repository (path relative to the doc), repeatable")
    args = ap.parse_args()
    datas = []
    for p in args.results:
        with open(p) as f:
            datas.append(json.load(f))
    plots = list(args.plot)
    for src in args.plots_from:
        os.makedirs(args.plots_to, exist_ok=True)
        for name in sorted(os.listdir(src)):
            if name.endswith(".png"):
                shutil.copy(os.path.join(src, name), os.path.join(args.plots_to, name))
                rel = os.path.relpath(os.path.join(args.plots_to, name),
                                      os.path.dirname(os.path.abspath(args.doc)) if args.doc else ".")
                if rel not in plots:
                    plots.append(rel)
    if args.doc:
        update_doc(args.doc, datas, plots, args.title)
        print(f"updated {args.doc}")
    else:
        sys.stdout.write(summary_markdown(datas))


if __name__ == "__main__":
    main()

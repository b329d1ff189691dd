#!/usr/bin/env python3
"""Realized work and fidelity of MALA on captured real attention inputs (lab/real/capture_qkv.py).

For each captured layer runs `mala run` (the exact CPU implementation by default) at the GPU
kernels' decision tiles and prints, per layer and over all layers: mean post-score key slots per
query, the fraction of legal tiles retained, the omitted softmax mass (mean / max over rows) and
the relative L2 error of O against tau = 0.  With --backward also the backward's slots per query
(its own run at the backward's tiles, random dO: the backward's test reads only the lse).

  python lab/real/real_stats.py --dir real/gpl3 --mala build/cli/mala --json real/gpl3/stats.json
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile


def run_mala(mala, files, tau, bq, bk, device, do=None):
    out = tempfile.mkdtemp(prefix="mala_real_")
    cmd = [mala, "run", "--q", files["q"], "--k", files["k"], "--v", files["v"], "--out", out, "--tau", str(tau),
           "--bq", str(bq), "--bk", str(bk), "--device", device, "--compare", "--json", "--quiet"]
    if do:
        cmd += ["--do", do]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"real_stats: {' '.join(cmd)} failed:\n{r.stderr}")
    for f in glob.glob(os.path.join(out, "*.npy")):
        os.remove(f)
    os.rmdir(out)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="capture directory (layerLL_{q,k,v}.npy, manifest.json)")
    ap.add_argument("--mala", default="build/cli/mala", help="the mala CLI")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fwd-tiles", default="32x64", help="forward decision tile (the d = 64 forward kernel's)")
    ap.add_argument("--bwd-tiles", default="64x128", help="backward decision tile (the backward kernel's)")
    ap.add_argument("--backward", action="store_true", help="also the backward's slots (one more run per layer)")
    ap.add_argument("--layers", default="", help="comma list of layers (default all)")
    ap.add_argument("--json", default="", help="write the per-layer results here")
    a = ap.parse_args()

    man = json.load(open(os.path.join(a.dir, "manifest.json")))
    layers = sorted(int(re.search(r"layer(\d+)_q", f).group(1)) for f in glob.glob(os.path.join(a.dir, "layer*_q.npy")))
    if a.layers:
        keep = {int(x) for x in a.layers.split(",")}
        layers = [L for L in layers if L in keep]
    fbq, fbk = (int(x) for x in a.fwd_tiles.split("x"))
    bbq, bbk = (int(x) for x in a.bwd_tiles.split("x"))
    do = None
    if a.backward:
        import numpy as np

        q = np.load(os.path.join(a.dir, f"layer{layers[0]:02d}_q.npy"))
        do = os.path.join(tempfile.mkdtemp(prefix="mala_real_do_"), "do.npy")
        np.save(do, np.random.default_rng(0).standard_normal(q.shape).astype(np.float16))

    n = man["n"]
    print(f"real regime: {man['model']} on {man['text']} (N = {n}, Hq {man['heads_q']}, Hkv {man['heads_kv']}, "
          f"d {man['head_dim']}), tau = {a.tau}, forward tiles {a.fwd_tiles}"
          + (f", backward tiles {a.bwd_tiles}" if a.backward else "") + f", {a.device}")
    print(f"{'layer':>5} {'fwd slots/q':>11} {'retained':>9} {'omit mean':>10} {'omit max':>10} "
          f"{'O relL2':>9}" + (f" {'bwd slots/q':>11}" if a.backward else ""))
    rows = []
    for L in layers:
        files = {t: os.path.join(a.dir, f"layer{L:02d}_{t}.npy") for t in "qkv"}
        f = run_mala(a.mala, files, a.tau, fbq, fbk, a.device)
        row = {"layer": L, "fwd_slots_mean": f["fwd_slots"]["mean"], "retained_fraction_fwd": f["retained_fraction_fwd"],
               "omitted_mean": f["omitted_mass"]["mean"], "omitted_max": f["omitted_mass"]["max"],
               "o_rel_l2": f["rel_l2_error_vs_tau0"]["o"]}
        if a.backward:
            b = run_mala(a.mala, files, a.tau, bbq, bbk, a.device, do)
            row["bwd_slots_mean"] = b["bwd_slots"]["mean"]
        rows.append(row)
        print(f"{L:5d} {row['fwd_slots_mean']:11.1f} "
              f"{100 * row['retained_fraction_fwd']:8.2f}% {row['omitted_mean']:10.2e} {row['omitted_max']:10.2e} "
              f"{row['o_rel_l2']:9.2e}" + (f" {row['bwd_slots_mean']:11.1f}" if a.backward else ""), flush=True)
    m = lambda k: sum(r[k] for r in rows) / len(rows)
    print(f"{'all':>5} {m('fwd_slots_mean'):11.1f} "
          f"{100 * m('retained_fraction_fwd'):8.2f}% {m('omitted_mean'):10.2e} {max(r['omitted_max'] for r in rows):10.2e} "
          f"{max(r['o_rel_l2'] for r in rows):9.2e}" + (f" {m('bwd_slots_mean'):11.1f}" if a.backward else "")
          + "   (means over layers; omitted max and O error: the worst layer)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"manifest": man, "tau": a.tau, "device": a.device, "fwd_tiles": a.fwd_tiles,
                       "bwd_tiles": a.bwd_tiles if a.backward else None, "layers": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

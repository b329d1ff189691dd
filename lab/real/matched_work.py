#!/usr/bin/env python3
"""Matched-work allocation study (the paper's Table 1) on captured attention states.

Four policies choose which (query block, key tile) decisions get post-score work; each gets exactly
MALA's total number of retained tiles:
  mala                 MALA's own online decisions at tau (the exact CPU implementation, the kernels'
                       forward tiles)
  oracle               per instance: each query-block decision keeps as many tiles as MALA kept
                       there, the ones of largest final reference mass (input/layer/head/position)
  layer_head_position  one allocation per (layer, head, distance from the diagonal in key tiles),
                       pooled over inputs and query blocks
  position             one allocation per distance from the diagonal, pooled over inputs, layers,
                       heads and query blocks
Regions (distances, or (layer, head, distance)) are ranked by their mean final reference mass per
tile and filled whole in that order; the last one that fits only in part is filled in a fixed order
(inputs, layers, heads, query blocks ascending), so every policy uses exactly MALA's tile count.

Every policy's output is the softmax restricted to its retained tiles (what MALA computes for its
own), so policies differ only in what they keep.  Per decision (input, layer, head, query block):
omitted mass = mean over the block's rows of 1 - (retained reference mass), error = relative L2 of the
block's output rows against full attention.  Reported: mean and P95 over decisions, and the work
(mean post-score key slots per query row).

  python3 lab/real/matched_work.py --states real-data/paper --out matched.json [--layers 0,5,10]
States: LAYER_{q,k,v}.npy as lab/real/capture_qkv.py and qwen_measure.py write them ([N, H, d]).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

import numpy as np
import torch

POLICIES = ("position", "layer_head_position", "oracle", "mala")


def kernel_tiles(d):
    """The CUDA forward kernels' decision tiles (docs/kernels.md, "Tiles")."""
    return (16, 32) if d == 256 else (32, 64)


def mala_masks(q, k, v, tau, bq, bk, cli, causal=True):
    """MALA's forward tile mask [H, nqt, nkt] (0 illegal, 1 skipped, 2 retained) from the exact CPU
    implementation at tiles bq x bk (`mala run`, which takes any tile size)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mala_mw_") as tmp:
        paths = {}
        for name, x in (("q", q), ("k", k), ("v", v)):
            paths[name] = os.path.join(tmp, f"{name}.npy")
            np.save(paths[name], x.numpy().astype(np.float32))
        out = os.path.join(tmp, "out")
        cmd = [cli, "run", "--q", paths["q"], "--k", paths["k"], "--v", paths["v"], "--out", out, "--tau", str(tau),
               "--bq", str(bq), "--bk", str(bk), "--device", "cpu", "--quiet"] + ([] if causal else ["--no-causal"])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"matched_work: {' '.join(cmd)} failed:\n{r.stderr}")
        return torch.from_numpy(np.load(os.path.join(out, "fwd_tile_mask.npy")).astype(np.int64))


def mala_masks_cuda(q, k, v, tau, causal=True):
    """MALA's forward tile mask [H, nqt, nkt] (TileState values) from the CUDA forward kernel itself,
    at its own tiles, and those tiles (bq, bk).  The decisions equal the CPU implementation's up to
    docs/spec.md's rounding flips (the GPU tests check it); the states are fp16, which the kernel reads
    exactly."""
    import mala

    qd, kd, vd = (x.to("cuda", torch.float16)[None] for x in (q, k, v))
    _, st = mala.attention(qd, kd, vd, tau=tau, causal=causal, return_stats=True)
    return st.fwd_tile_mask[0].to("cpu", torch.int64), (st.fwd_block_q, st.fwd_block_k)


class Instance:
    """One (input, layer): per head, the reference tile masses and what policies need."""

    def __init__(self, key, q, k, v, bq, bk, causal=True, chunk=1024, device="cpu"):
        # q, k, v and the per-row work (probabilities, outputs) live on `device`; the per-tile
        # tensors the policies use (block_mass, masks) stay on the CPU.
        self.device = torch.device(device)
        self.key, self.q, self.k, self.v = key, q.to(self.device), k.to(self.device), v.to(self.device)
        self.n, self.hq, self.d = q.shape
        self.hkv = k.shape[1]
        self.bq, self.bk, self.causal, self.chunk = bq, bk, causal, chunk
        self.nqt, self.nkt = math.ceil(self.n / bq), math.ceil(self.n / bk)
        self.scale = 1.0 / math.sqrt(self.d)
        # block mass [H, nqt, nkt]: the sum over a block's rows of the row's reference mass in the tile
        self.block_mass = torch.zeros(self.hq, self.nqt, self.nkt, dtype=torch.float64)
        for h in range(self.hq):
            for r0, p in self._probs(h):
                tile = self._tile_sums(p).double().cpu()  # [rows, nkt]
                rows = torch.arange(r0, r0 + p.shape[0])
                self.block_mass[h].index_add_(0, rows // bq, tile)

    def _probs(self, h):
        """Reference probabilities of head h in row chunks: (first row, P [rows, N])."""
        kh = self.k[:, h // (self.hq // self.hkv)]
        for r0 in range(0, self.n, self.chunk):
            r1 = min(self.n, r0 + self.chunk)
            s = (self.q[r0:r1, h] @ kh.T) * self.scale
            if self.causal:
                rows = torch.arange(r0, r1, device=self.device)[:, None]
                s = s.masked_fill(torch.arange(self.n, device=self.device)[None, :] > rows, -math.inf)
            yield r0, torch.softmax(s, dim=-1)

    def _tile_sums(self, p):
        pad = self.nkt * self.bk - self.n
        if pad:
            p = torch.nn.functional.pad(p, (0, pad))
        return p.reshape(p.shape[0], self.nkt, self.bk).sum(-1)

    def legal(self):
        """[nqt, nkt] bool: the tile holds a key some row of the block sees."""
        last_row = torch.clamp(torch.arange(self.nqt) * self.bq + self.bq - 1, max=self.n - 1)
        first_key = torch.arange(self.nkt) * self.bk
        if not self.causal:
            return torch.ones(self.nqt, self.nkt, dtype=torch.bool)
        return first_key[None, :] <= last_row[:, None]

    def distance(self):
        """[nqt, nkt] distance in key tiles from the block's diagonal tile (its last legal one)."""
        last_row = torch.clamp(torch.arange(self.nqt) * self.bq + self.bq - 1, max=self.n - 1)
        diag = last_row // self.bk if self.causal else torch.full((self.nqt,), self.nkt - 1)
        return diag[:, None] - torch.arange(self.nkt)[None, :]

    def evaluate(self, keeps):
        """keeps {name: [H, nqt, nkt] bool} -> {name: (omitted mass, relative error)} per decision
        (H x nqt); the reference probabilities are computed once for all of them."""
        dev = self.device
        z = lambda: torch.zeros(self.hq, self.nqt, dtype=torch.float64, device=dev)  # noqa: E731
        acc = {name: (z(), z(), z()) for name in keeps}
        rows_in = torch.zeros(self.nqt, dtype=torch.float64)
        rows_in.index_add_(0, torch.arange(self.n) // self.bq, torch.ones(self.n, dtype=torch.float64))
        for h in range(self.hq):
            vh = self.v[:, h // (self.hq // self.hkv)]
            keep_h = {name: keep[h].to(dev) for name, keep in keeps.items()}
            for r0, p in self._probs(h):
                blk = torch.arange(r0, r0 + p.shape[0], device=dev) // self.bq
                o_ref = p @ vh
                ref2 = (o_ref ** 2).sum(-1).double()
                for name in keeps:
                    omitted, err_num, err_den = acc[name]
                    kmask = keep_h[name][blk].repeat_interleave(self.bk, dim=1)[:, : self.n]  # [rows, N]
                    pk = p * kmask
                    kept = pk.sum(-1)
                    o = (pk @ vh) / kept.clamp_min(1e-30)[:, None]
                    omitted[h].index_add_(0, blk, (1.0 - kept).double())
                    err_num[h].index_add_(0, blk, ((o - o_ref) ** 2).sum(-1).double())
                    err_den[h].index_add_(0, blk, ref2)
        return {name: (om.cpu() / rows_in, torch.sqrt(en.cpu() / ed.cpu().clamp_min(1e-300)))
                for name, (om, en, ed) in acc.items()}


def fill_regions(instances, region_ids, budget):
    """keep masks for a pooled policy: regions ranked by mean reference mass per tile, filled whole
    in that order; the last one in part, in a fixed order (instances, heads, query blocks, key tiles
    ascending), so that exactly `budget` tiles are kept.  region_ids(inst) -> [H, nqt, nkt] int64."""
    ids = torch.cat([region_ids(i).flatten() for i in instances])
    legal = torch.cat([i.legal()[None].expand(i.hq, -1, -1).flatten() for i in instances])
    mass = torch.cat([i.block_mass.flatten() for i in instances])
    n_reg = int(ids.max()) + 1
    reg_mass = torch.bincount(ids[legal], weights=mass[legal], minlength=n_reg)
    reg_count = torch.bincount(ids[legal], minlength=n_reg)
    present = (reg_count > 0).nonzero().flatten()
    order = present[torch.argsort(-(reg_mass[present] / reg_count[present]), stable=True)]
    cum = torch.cumsum(reg_count[order], 0)
    whole = order[cum <= budget]
    left = budget - int(reg_count[whole].sum())
    chosen = torch.zeros(n_reg, dtype=torch.bool)
    chosen[whole] = True
    keep = legal & chosen[ids]
    if left > 0:
        partial = order[len(whole)]
        cand = (legal & (ids == partial)).nonzero().flatten()[:left]
        keep[cand] = True
    out, at = [], 0
    for i in instances:
        size = i.hq * i.nqt * i.nkt
        out.append(keep[at:at + size].reshape(i.hq, i.nqt, i.nkt))
        at += size
    return out


def oracle_keep(inst, n_keep):
    """Per decision, the n_keep[h, qi] legal tiles of largest block mass."""
    keep = torch.zeros(inst.hq, inst.nqt, inst.nkt, dtype=torch.bool)
    legal = inst.legal()
    m = inst.block_mass.masked_fill(~legal[None], -math.inf)
    order = torch.argsort(m, dim=-1, descending=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(inst.nkt).expand_as(order).contiguous())
    return (ranks < n_keep[..., None]) & legal[None]


def study(instances, mala_keeps):
    """Every policy's keep masks, matched to MALA's total; returns {policy: [keep per instance]}."""
    budget = sum(int(k.sum()) for k in mala_keeps)
    out = {"mala": mala_keeps, "oracle": [oracle_keep(i, k.sum(-1)) for i, k in zip(instances, mala_keeps)]}
    max_d = max(i.nkt for i in instances)
    out["position"] = fill_regions(instances, lambda i: i.distance().clamp(min=0)[None].expand(i.hq, -1, -1),
                                   budget)
    layer_index = {key: n for n, key in enumerate(sorted({i.key[1] for i in instances}))}
    out["layer_head_position"] = fill_regions(
        instances, lambda i: ((layer_index[i.key[1]] * i.hq + torch.arange(i.hq)[:, None, None]) * max_d
                              + i.distance().clamp(min=0)[None]), budget)
    return out


def summarize_all(instances, keeps):
    """{policy: {slots, tiles, omitted_mean, omitted_p95, err_mean, err_p95, decisions}}, pooled over
    every (input, layer, head, query block) decision."""
    om = {p: [] for p in keeps}
    er = {p: [] for p in keeps}
    slots = {p: 0.0 for p in keeps}
    rows = 0.0
    for i, inst in enumerate(instances):
        res = inst.evaluate({p: keeps[p][i] for p in keeps})
        rows_in = torch.zeros(inst.nqt, dtype=torch.float64)
        rows_in.index_add_(0, torch.arange(inst.n) // inst.bq, torch.ones(inst.n, dtype=torch.float64))
        for p, (o, e) in res.items():
            om[p].append(o.flatten())
            er[p].append(e.flatten())
            slots[p] += float((keeps[p][i].sum(-1).double() * rows_in[None]).sum()) * inst.bk
        rows += inst.n * inst.hq
    out = {}
    for p in keeps:
        o, e = torch.cat(om[p]), torch.cat(er[p])
        out[p] = {"slots": slots[p] / rows, "tiles": int(sum(int(k.sum()) for k in keeps[p])),
                  "omitted_mean": float(o.mean()), "omitted_p95": float(torch.quantile(o.float(), 0.95)),
                  "err_mean": float(e.mean()), "err_p95": float(torch.quantile(e.float(), 0.95)),
                  "decisions": int(o.numel())}
    return out


def summarize(instances, keeps):
    """summarize_all for one policy's keep masks."""
    return summarize_all(instances, {"policy": keeps})["policy"]


def load_layers(states, layers, n):
    files = sorted(glob.glob(os.path.join(states, "layer*_q.npy")))
    out = []
    for f in files:
        li = int(re.search(r"layer(\d+)_q\.npy$", f).group(1))
        if layers and li not in layers:
            continue
        q, k, v = (torch.from_numpy(np.load(f.replace("_q.npy", f"_{x}.npy")).astype(np.float32)) for x in "qkv")
        if n:
            q, k, v = q[:n], k[:n], v[:n]
        out.append((li, q, k, v))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--states", required=True, action="append", help="a capture directory (repeat: inputs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="", help="comma-separated layer indices (default all)")
    ap.add_argument("--n", type=int, default=0, help="first N rows (default all)")
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--key", default=None, help="the result's key (default N)")
    ap.add_argument("--mala", default="build/cli/mala", help="the mala CLI (its CPU implementation decides)")
    ap.add_argument("--bq", type=int, default=0, help="decision tile rows (default: the CUDA forward's)")
    ap.add_argument("--bk", type=int, default=0, help="decision tile keys (default: the CUDA forward's)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: MALA's decisions from the CUDA forward kernel (its tile mask, at its tiles) and "
                         "the reference probabilities on the GPU; cpu: the CLI's exact CPU implementation")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    layers = {int(x) for x in a.layers.split(",") if x}
    instances, mala_keeps = [], []
    for s_i, states in enumerate(a.states):
        for li, q, k, v in load_layers(states, layers, a.n):
            if a.device == "cuda":
                if a.bq or a.bk:
                    raise SystemExit("matched_work: --device cuda decides at the kernel's own tiles (no --bq/--bk)")
                mask, (bq, bk) = mala_masks_cuda(q, k, v, a.tau)
            else:
                bq, bk = (a.bq, a.bk) if a.bq and a.bk else kernel_tiles(q.shape[-1])
                mask = mala_masks(q, k, v, a.tau, bq, bk, a.mala)
            inst = Instance((s_i, li), q, k, v, bq, bk, device=a.device)
            instances.append(inst)
            mala_keeps.append(mask == 2)
            print(f"input {s_i} layer {li}: N={inst.n} H={inst.hq} tiles {bq}x{bk}, MALA keeps "
                  f"{int((mask == 2).sum())} of {int((mask > 0).sum())} legal tiles", flush=True)
    keeps = study(instances, mala_keeps)
    res = summarize_all(instances, {p: keeps[p] for p in POLICIES})
    key = a.key or str(instances[0].n)
    doc = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc[key] = dict(res, scope={"states": a.states, "layers": sorted({i.key[1] for i in instances}),
                                "tau": a.tau, "tiles": f"{instances[0].bq}x{instances[0].bk}",
                                "decisions_by": "the CUDA forward kernel" if a.device == "cuda"
                                else "the CPU implementation (mala CLI)"})
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for p in POLICIES:
        r = res[p]
        print(f"{p:20s} slots/query {r['slots']:8.1f}  tiles {r['tiles']:8d}  omitted mean {r['omitted_mean']:.3e} "
              f"p95 {r['omitted_p95']:.3e}  err mean {r['err_mean']:.3e} p95 {r['err_p95']:.3e}")


if __name__ == "__main__":
    main()

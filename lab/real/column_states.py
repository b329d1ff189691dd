"""Synthetic states whose skipped tiles follow the key tile (a column-structured skip pattern).

Writes PREFIX_q.npy, PREFIX_k.npy, PREFIX_v.npy ([N, H, d] float16, the layout of the real
states that `mala_bench --real PREFIX` reads).  Every element is N(0, 1), as in the random
regime, except for one channel: every query carries `beta` there, and the keys of a "dull" key
tile (a fraction `--dull` of the 128-key tiles of each KV head, drawn at random) carry
`-delta * sqrt(d) / beta`, so their scores sit `delta` (natural-log units) below the others'.
The tiles a backward CTA (one key tile) skips then depend on its column, so the CTAs' durations
vary with the column, which the random and synthetic regimes keep uniform.  A dull tile is skipped
at tau = 1 once its largest entry over a decision tile sits below the bound: at d = 128 and 32K
that takes delta >= 6 (75% of backward tiles kept; delta 4 keeps 96%).  On the H100 these inputs
run the tau = 1 backward 1.2x faster than tau = 0 (mala_bench_bwd_columns_h100.log in commit 831db3a):
a CTA that skips skips everything and adds no dQ.  `--pattern mixed` (make_mixed) gives tile-level
skips at a rate drawn per key tile, so every CTA adds dQ at its own pace, as in the real layers; with
--dull 0.35 it reproduced the H100's slow tau = 1 backward of real layers 6 and 19 (18.75 against
14.3-14.9 ms at tau = 0, L2 hit rate 42%), which the backward's launch order fixed
(docs/journal.md, "Backward head splits and launch order").

    python3 lab/real/column_states.py --out /tmp/cols/d6 --dull 0.25 --delta 6
    mala_bench --op bwd --real /tmp/cols/d6 --tau 0,1 --fwd-mask --interleave
    python3 lab/real/column_states.py --out /tmp/cols/mixed --pattern mixed --dull 0.2
"""

import argparse
import os

import numpy as np


def _random_qkv(rng, n, hq, hkv, d):
    """The random regime's q, k, v (fp32, [N, H, d]) from rng."""
    return (rng.standard_normal((n, hq, d), dtype=np.float32), rng.standard_normal((n, hkv, d), dtype=np.float32),
            rng.standard_normal((n, hkv, d), dtype=np.float32))


def make(n, hq, hkv, d, dull, delta, beta, seed, tile=128):
    rng = np.random.default_rng(seed)
    q, k, v = _random_qkv(rng, n, hq, hkv, d)
    q[:, :, 0] += beta
    n_tiles = -(-n // tile)
    dull_tiles = rng.random((n_tiles, hkv)) < dull
    dull_tiles[0, :] = False  # the first tile (an attention sink's place) stays
    per_key = np.repeat(dull_tiles, tile, axis=0)[:n]  # [n, hkv]
    k[:, :, 0] += np.where(per_key, -delta * np.sqrt(d) / beta, 0.0).astype(np.float32)
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), dull_tiles


def make_mixed(n, hq, hkv, d, dull, delta, beta, seed, channels=16, q_tile=64, tile=128):
    """Tile-level skips whose rate varies by key tile: key tile J of KV head g is dull on each of
    `channels` channels with probability f (drawn per tile, uniform in [0, 2 dull], at most 1), and
    each 64-row query block of each query head reads one channel (drawn per block and head): the
    block's scores against J sit delta below the others' where J is dull on its channel.  The
    channels carry no noise; the other d - channels dimensions are N(0, 1).  Returns q, k, v and
    the [query block, query head, key tile] map of dull tiles."""
    if not 1 <= channels < d:
        raise ValueError("channels must be in [1, d)")
    rng = np.random.default_rng(seed)
    q, k, v = _random_qkv(rng, n, hq, hkv, d)
    n_qb, n_kt, group = -(-n // q_tile), -(-n // tile), hq // hkv
    chan = rng.integers(0, channels, size=(n_qb, hq))
    rate = np.minimum(rng.uniform(0.0, 2.0 * dull, size=(n_kt, hkv)), 1.0)
    dull_ch = rng.random((n_kt, hkv, channels)) < rate[:, :, None]
    dull_ch[0] = False  # the first key tile (an attention sink's place) stays
    onehot = np.zeros((n_qb, hq, channels), dtype=np.float32)
    np.put_along_axis(onehot, chan[:, :, None], beta, axis=2)
    q[:, :, :channels] = np.repeat(onehot, q_tile, axis=0)[:n]
    k[:, :, :channels] = np.repeat(np.where(dull_ch, -delta * np.sqrt(d) / beta, 0.0), tile, axis=0)[:n]
    heads_g = np.arange(hq) // group  # each query head's KV head
    dull_map = dull_ch[:, heads_g, :]  # [key tile, query head, channel]
    dull_map = np.take_along_axis(dull_map[None], chan[:, None, :, None], axis=3)[..., 0]  # [qb, kt, hq]
    return (q.astype(np.float16), k.astype(np.float16), v.astype(np.float16),
            np.transpose(dull_map, (0, 2, 1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path prefix of the three .npy files")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--hq", type=int, default=12)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dull", type=float, default=0.25, help="fraction of dull key tiles per KV head")
    ap.add_argument("--delta", type=float, default=6.0, help="how far below the others a dull tile's scores sit")
    ap.add_argument("--beta", type=float, default=8.0, help="the queries' value on the shared channel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pattern", choices=("columns", "mixed"), default="columns",
                    help="columns: whole key tiles dull; mixed: per query block and key tile (make_mixed)")
    a = ap.parse_args()
    for name, val in (("--n", a.n), ("--hq", a.hq), ("--hkv", a.hkv), ("--d", a.d)):
        if val < 1:
            ap.error(f"{name} must be >= 1")
    if a.hq % a.hkv:
        ap.error("--hq must be a multiple of --hkv")
    if not 0.0 <= a.dull <= 1.0:
        ap.error("--dull must be in [0, 1]")
    if a.beta <= 0:
        ap.error("--beta must be > 0")
    build = make if a.pattern == "columns" else make_mixed
    q, k, v, dull_tiles = build(a.n, a.hq, a.hkv, a.d, a.dull, a.delta, a.beta, a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        np.save(f"{a.out}_{name}.npy", x)
    print(f"{a.out}: N={a.n} Hq={a.hq} Hkv={a.hkv} d={a.d}, {a.pattern}, {dull_tiles.mean():.1%} of tiles dull "
          f"(delta {a.delta:g}, beta {a.beta:g}, seed {a.seed})")


if __name__ == "__main__":
    main()

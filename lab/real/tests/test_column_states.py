"""lab/real/column_states.py: synthetic states whose skipped tiles follow the key tile."""

import numpy as np

import script_fixtures  # noqa: F401  (puts lab/real on sys.path)


def test_shapes_dtype_and_dull_fraction():
    import column_states

    q, k, v, dull = column_states.make(n=1000, hq=4, hkv=2, d=64, dull=0.5, delta=4.0, beta=8.0, seed=3)
    assert q.shape == (1000, 4, 64) and k.shape == (1000, 2, 64) and v.shape == (1000, 2, 64)
    assert q.dtype == k.dtype == v.dtype == np.float16
    assert dull.shape == (8, 2)  # ceil(1000 / 128) key tiles per KV head
    assert not dull[0].any()  # the first tile is never dull
    assert 0 < dull[1:].mean() < 1


def test_dull_tiles_score_delta_below_the_others():
    import column_states

    d, delta, beta = 64, 4.0, 8.0
    q, k, _, dull = column_states.make(n=512, hq=2, hkv=1, d=d, dull=0.5, delta=delta, beta=beta, seed=1)
    # The shared channel's part of a score: beta * k[:, 0] / sqrt(d), about -delta on dull keys' tiles.
    shared = beta * k[:, 0, 0].astype(np.float64) / np.sqrt(d)
    per_key = np.repeat(dull[:, 0], 128)[:512]
    assert per_key.any() and (~per_key).any()
    gap = shared[~per_key].mean() - shared[per_key].mean()
    assert abs(gap - delta) < 0.3
    # Without dull tiles the inputs are the plain random regime's draws plus the query channel.
    q0, k0, _, dull0 = column_states.make(n=512, hq=2, hkv=1, d=d, dull=0.0, delta=delta, beta=beta, seed=1)
    assert not dull0.any()
    assert abs(q0[:, :, 0].astype(np.float64).mean() - beta) < 0.2
    assert abs(k0[:, :, 0].astype(np.float64).mean()) < 0.2


def test_mixed_pattern_scores_follow_the_dull_map():
    import column_states

    n, hq, hkv, d, delta, beta = 640, 4, 2, 64, 6.0, 8.0
    q, k, _, dull = column_states.make_mixed(n, hq, hkv, d, dull=0.3, delta=delta, beta=beta, seed=2, channels=8)
    assert dull.shape == (10, 4, 5)  # [64-row query blocks, query heads, 128-key tiles]
    assert not dull[:, :, 0].any() and dull.any() and not dull.all()
    qf, kf = q.astype(np.float64), k.astype(np.float64)
    for h in range(hq):
        g = h // (hq // hkv)
        # The channels' part of every score: exactly -delta where the map says dull, else 0.
        part = qf[:, h, :8] @ kf[:, g, :8].T / np.sqrt(d)  # [n, n]
        want = np.where(np.repeat(np.repeat(dull[:, h, :], 64, axis=0), 128, axis=1)[:n, :n], -delta, 0.0)
        assert np.abs(part - want).max() < 0.05

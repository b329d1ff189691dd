"""CPU tests of the MQAR generator (lab/ar/ar_data.py): placement, labels, the query distribution,
determinism."""

import os
import sys

import pytest

np = pytest.importorskip("numpy")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ar_data  # noqa: E402
from ar_data import FILL, IGNORE, ARConfig  # noqa: E402

PAPER = ARConfig()  # 8192 tokens, 256 pairs, 256 queries, a = 0.01


@pytest.mark.parametrize("cfg", [ARConfig(seqlen=1024), ARConfig(seqlen=2048, n_pass=2),
                                 ARConfig(seqlen=96, n_kv=8, n_q=8, vocab=64)])
def test_pairs_queries_and_labels(cfg):
    for index in range(3):
        tok, lab, offsets = ar_data.make_example(cfg, 11, index)
        assert tok.shape == lab.shape == (cfg.seqlen,)
        P = cfg.prefix
        keys, values = tok[0:2 * cfg.n_kv:2], tok[1:2 * cfg.n_kv:2]
        # Pairs: contiguous at the start, repeated n_pass times, keys and values in their ranges.
        assert np.array_equal(tok[:P], np.tile(tok[:2 * cfg.n_kv], cfg.n_pass))
        assert keys.min() >= 1 and keys.max() <= cfg.n_keys
        assert values.min() > cfg.n_keys and values.max() < cfg.vocab
        assert len(set(keys.tolist())) == cfg.n_kv and len(set(values.tolist())) == cfg.n_kv
        # Nothing in the prefix is scored; the suffix is FILL except at the queries.
        assert (lab[:P] == IGNORE).all()
        qpos = np.flatnonzero(lab != IGNORE)
        assert len(qpos) == cfg.n_q and qpos.min() >= P
        assert np.array_equal(np.sort(P + offsets), qpos)
        assert len(set(offsets.tolist())) == cfg.n_q
        rest = np.setdiff1d(np.arange(P, cfg.seqlen), qpos)
        assert (tok[rest] == FILL).all()
        # Each query is a key of the prefix (each asked once); its label is that key's value.
        value_of = dict(zip(keys.tolist(), values.tolist()))
        qkeys = tok[qpos].tolist()
        assert len(set(qkeys)) == cfg.n_q
        assert all(lab[p] == value_of[k] for p, k in zip(qpos.tolist(), qkeys))


def test_deterministic_and_streams_differ():
    cfg = ARConfig(seqlen=1024)
    a, b = ar_data.make_batch(cfg, 5, [0, 1]), ar_data.make_batch(cfg, 5, [0, 1])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(ar_data.make_batch(cfg, 6, [0])[0], a[0][:1])
    assert not np.array_equal(a[0][0], a[0][1])
    t1, t2 = ar_data.test_set(cfg, 3), ar_data.test_set(cfg, 3)
    assert np.array_equal(t1[0], t2[0]) and not np.array_equal(t1[0][0], a[0][0])
    # The pool order depends on the seed; the pool itself does not.
    s1, s2 = ar_data.TrainStream(cfg, 8, 4, seed=1), ar_data.TrainStream(cfg, 8, 4, seed=2)
    e1 = np.concatenate([s1.next()[0], s1.next()[0]])
    e2 = np.concatenate([s2.next()[0], s2.next()[0]])
    assert not np.array_equal(e1, e2)
    assert sorted(map(bytes, e1)) == sorted(map(bytes, e2))


def test_config_checks():
    with pytest.raises(ValueError, match="suffix"):
        ARConfig(seqlen=600).check()  # 512-token prefix leaves 88 positions for 256 queries
    with pytest.raises(ValueError, match="vocab"):
        ARConfig(seqlen=1024, vocab=300).check()


def _log2_bins(offsets, suffix):
    """Counts of t = offset + 1 in [1, 2), [2, 4), [4, 8), ..."""
    edges = [1 << i for i in range(int(np.ceil(np.log2(suffix + 1))) + 1)]
    return np.histogram(offsets + 1, bins=edges)[0], edges


# chi-square 0.999 quantile, 12 degrees of freedom (13 bins for a suffix of 7,680)
CHI2_12_999 = 32.909


def _chi2_first_draw(first, suffix, p):
    obs, edges = _log2_bins(first, suffix)
    t = np.arange(1, suffix + 1)
    exp = np.array([p[(t >= lo) & (t < hi)].sum() for lo, hi in zip(edges[:-1], edges[1:])]) * len(first)
    assert len(obs) == 13 and exp.min() > 20
    return float(((obs - exp) ** 2 / exp).sum())


def test_query_distribution_follows_power_law():
    S = PAPER.suffix
    p = ar_data.suffix_probs(S, PAPER.power_a)
    rng = np.random.default_rng(123)
    draws = [ar_data.sample_query_offsets(rng, S, PAPER.n_q, PAPER.power_a) for _ in range(3000)]
    # The first draw of successive sampling without replacement is a draw from p itself.
    first = np.array([d[0] for d in draws])
    assert _chi2_first_draw(first, S, p) < CHI2_12_999
    # The same test rejects a uniform sampler (fixed seed: deterministic).
    uni = np.array([rng.choice(S, PAPER.n_q, replace=False)[0] for _ in range(3000)])
    assert _chi2_first_draw(uni, S, p) > 10 * CHI2_12_999
    # The whole query set leans to the start of the suffix; uniform would put 10% in its first tenth.
    allq = np.concatenate(draws)
    assert (allq < S // 10).mean() > 0.3
    assert (np.concatenate([rng.choice(S, PAPER.n_q, replace=False) for _ in range(200)]) < S // 10).mean() < 0.12


def test_generated_examples_use_the_sampler():
    # End to end through make_example: queries crowd the start of the suffix.
    offs = np.concatenate([ar_data.make_example(PAPER, 3, i)[2] for i in range(20)])
    assert (offs < PAPER.suffix // 10).mean() > 0.3

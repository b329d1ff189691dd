"""Multi-query associative recall (MQAR), as the paper's appendix describes it (issue #65).

A sequence of length N holds n_kv key-value pairs contiguously at its start, repeated n_pass times
(the first P = 2 * n_kv * n_pass tokens: k_1 v_1 k_2 v_2 ...).  The rest, the suffix of S = N - P
positions, holds n_q queries: each is one of the keys, at a suffix position t (1-based) drawn
without replacement with p(t) proportional to t^(a - 1), and the model must emit that key's value
at the query's own position.  Only query positions are scored (labels are IGNORE elsewhere).
Every other suffix position holds the single FILL token: the paper inserts no random padding or
noise tokens, so the suffix carries no information except the queries themselves.

Vocabulary: 0 is FILL, keys are 1 .. n_keys, values n_keys + 1 .. vocab - 1.  Keys and values of
one sequence are drawn without replacement; each key is queried once when n_q == n_kv.

Every example is a pure function of (stream seed, example index), so a training pool and the test
set are fixed by their seeds alone, whatever the batch size or the method being trained.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

FILL = 0
IGNORE = -100
TEST_SEED = 1_000_003  # the fixed test set's stream; training pools use other seeds
TRAIN_POOL_SEED = 7    # the training pool's stream: the same examples for every method and seed


@dataclass(frozen=True)
class ARConfig:
    seqlen: int = 8192
    n_kv: int = 256
    n_q: int = 256
    n_pass: int = 1
    vocab: int = 8192
    power_a: float = 0.01

    @property
    def prefix(self) -> int:
        return 2 * self.n_kv * self.n_pass

    @property
    def suffix(self) -> int:
        return self.seqlen - self.prefix

    @property
    def n_keys(self) -> int:
        return (self.vocab - 1) // 2

    @property
    def n_values(self) -> int:
        return self.vocab - 1 - self.n_keys

    def check(self):
        if self.suffix < self.n_q:
            raise ValueError(f"seqlen {self.seqlen}: the suffix ({self.suffix} positions after the "
                             f"{self.prefix}-token prefix) cannot hold {self.n_q} queries")
        if self.n_q > self.n_kv:
            raise ValueError(f"n_q {self.n_q} > n_kv {self.n_kv}: a key would be queried twice")
        if self.n_keys < self.n_kv or self.n_values < self.n_kv:
            raise ValueError(f"vocab {self.vocab}: too small for {self.n_kv} distinct keys and values")
        if not 0.0 < self.power_a <= 1.0:
            raise ValueError(f"power_a {self.power_a}: must lie in (0, 1]")

    def to_dict(self):
        return asdict(self)


def suffix_log_weights(suffix: int, power_a: float) -> np.ndarray:
    """log p(t) up to a constant, t = 1 .. suffix: p(t) proportional to t^(a - 1)."""
    t = np.arange(1, suffix + 1, dtype=np.float64)
    return (power_a - 1.0) * np.log(t)


def suffix_probs(suffix: int, power_a: float) -> np.ndarray:
    w = np.exp(suffix_log_weights(suffix, power_a))
    return w / w.sum()


def sample_query_offsets(rng: np.random.Generator, suffix: int, n_q: int, power_a: float) -> np.ndarray:
    """n_q distinct 0-based suffix offsets (t - 1), in draw order.

    Gumbel top-k: the n_q largest of log p(t) + Gumbel noise, taken in decreasing order, are
    distributed exactly as n_q successive draws without replacement from p (each draw from p
    renormalized over what is left), so the first offset is a draw from p itself.
    """
    keys = suffix_log_weights(suffix, power_a) + rng.gumbel(size=suffix)
    top = np.argpartition(-keys, n_q - 1)[:n_q]
    return top[np.argsort(-keys[top], kind="stable")]


def make_example(cfg: ARConfig, seed: int, index: int):
    """(tokens [N] int64, labels [N] int64, query offsets in draw order) of example `index` of the
    stream `seed`."""
    rng = np.random.default_rng([int(seed), int(index)])
    keys = rng.choice(cfg.n_keys, size=cfg.n_kv, replace=False) + 1
    values = rng.choice(cfg.n_values, size=cfg.n_kv, replace=False) + 1 + cfg.n_keys
    pairs = np.empty(2 * cfg.n_kv, dtype=np.int64)
    pairs[0::2], pairs[1::2] = keys, values
    tokens = np.full(cfg.seqlen, FILL, dtype=np.int64)
    tokens[:cfg.prefix] = np.tile(pairs, cfg.n_pass)
    labels = np.full(cfg.seqlen, IGNORE, dtype=np.int64)
    offsets = sample_query_offsets(rng, cfg.suffix, cfg.n_q, cfg.power_a)
    which = rng.permutation(cfg.n_kv)[:cfg.n_q]  # which pair each query asks for
    pos = cfg.prefix + offsets
    tokens[pos] = keys[which]
    labels[pos] = values[which]
    return tokens, labels, offsets


def make_batch(cfg: ARConfig, seed: int, indices):
    """tokens, labels: int64 arrays [len(indices), N]."""
    cfg.check()
    toks, labs = [], []
    for i in indices:
        t, l, _ = make_example(cfg, seed, int(i))
        toks.append(t)
        labs.append(l)
    return np.stack(toks), np.stack(labs)


def test_set(cfg: ARConfig, n_test: int):
    """The fixed test set: the first n_test examples of the TEST_SEED stream."""
    return make_batch(cfg, TEST_SEED, range(n_test))


class TrainStream:
    """Batches from a fixed pool of n_train examples (stream TRAIN_POOL_SEED), in an order that
    `seed` fixes: a fresh permutation of the pool each epoch."""

    def __init__(self, cfg: ARConfig, n_train: int, batch: int, seed: int):
        if n_train < batch:
            raise ValueError(f"n_train {n_train} < batch {batch}")
        self.cfg, self.n_train, self.batch = cfg, int(n_train), int(batch)
        self.rng = np.random.default_rng([int(seed), 0xA5])
        self.order, self.pos, self.epoch = self.rng.permutation(self.n_train), 0, 0

    def next(self):
        if self.pos + self.batch > self.n_train:
            self.order, self.pos, self.epoch = self.rng.permutation(self.n_train), 0, self.epoch + 1
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return make_batch(self.cfg, TRAIN_POOL_SEED, idx)

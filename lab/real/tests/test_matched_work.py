"""lab/real/matched_work.py on a small case: exact work matching, and the oracle's optimality checked
by brute force over every tile subset of each decision."""

import itertools
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

import matched_work as mw  # noqa: E402

CLI = os.environ.get("MALA_CLI", os.path.join(ROOT, "build", "cli", "mala"))


def sharp_layer(seed, n=512, hq=2, hkv=1, d=64):
    """Keys drift slowly along the sequence and queries look like nearby keys: local, sharp attention
    that MALA partly skips."""
    g = torch.Generator().manual_seed(seed)
    walk = torch.cumsum(torch.randn(n, hkv, d, generator=g) * 0.35, dim=0)
    k = walk + 0.3 * torch.randn(n, hkv, d, generator=g)
    q = walk.repeat_interleave(hq // hkv, dim=1) + 0.3 * torch.randn(n, hq, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    return q, k, v


@pytest.fixture(scope="module")
def case():
    if not os.access(CLI, os.X_OK):
        pytest.skip(f"the mala CLI is not built ({CLI})")
    insts, keeps = [], []
    for layer in range(2):
        q, k, v = sharp_layer(layer)
        bq, bk = mw.kernel_tiles(q.shape[-1])
        mask = mw.mala_masks(q, k, v, 1.0, bq, bk, CLI)
        inst = mw.Instance((0, layer), q, k, v, bq, bk)
        assert torch.equal(mask[0] > 0, inst.legal()), "legality differs from the CPU implementation's"
        insts.append(inst)
        keeps.append(mask == 2)
    return insts, keeps, mw.study(insts, keeps)


def test_mala_skips_part_of_the_case(case):
    insts, keeps, _ = case
    kept = sum(int(k.sum()) for k in keeps)
    legal = sum(int(i.legal().sum()) * i.hq for i in insts)
    assert 0 < kept < legal, (kept, legal)


def test_every_policy_uses_exactly_malas_tiles_and_only_legal_ones(case):
    insts, keeps, res = case
    budget = sum(int(k.sum()) for k in keeps)
    for policy, ks in res.items():
        assert sum(int(k.sum()) for k in ks) == budget, policy
        for inst, k in zip(insts, ks):
            assert not (k & ~inst.legal()[None]).any(), policy


def test_oracle_is_optimal_per_decision_by_brute_force(case):
    insts, keeps, res = case
    for inst, mala_keep, oracle_keep in zip(insts, keeps, res["oracle"]):
        legal = inst.legal()
        for h in range(inst.hq):
            for qi in range(inst.nqt):
                n = int(mala_keep[h, qi].sum())
                assert int(oracle_keep[h, qi].sum()) == n
                tiles = legal[qi].nonzero().flatten().tolist()
                mass = inst.block_mass[h, qi]
                best = max((sum(float(mass[t]) for t in sub) for sub in itertools.combinations(tiles, n)),
                           default=0.0)
                assert float(mass[oracle_keep[h, qi]].sum()) >= best - 1e-12


def test_oracle_omits_no_more_than_mala_and_reports_are_complete(case):
    insts, _, res = case
    out = {p: mw.summarize(insts, res[p]) for p in mw.POLICIES}
    assert out["oracle"]["omitted_mean"] <= out["mala"]["omitted_mean"] + 1e-12
    for p in mw.POLICIES:
        assert {"slots", "omitted_mean", "omitted_p95", "err_mean", "err_p95"} <= set(out[p])
        assert out[p]["slots"] == pytest.approx(out["mala"]["slots"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_decisions_and_evaluation_match_the_cpu_path():
    """--device cuda: the CUDA kernel's tile mask equals the CPU implementation's at the same tiles
    (up to docs/spec.md's rounding flips), and the evaluation on the GPU equals the one on the CPU."""
    pytest.importorskip("mala")
    if not os.path.exists(CLI):
        pytest.skip(f"no mala CLI at {CLI} (set MALA_CLI)")
    q, k, v = (x.half().float() for x in sharp_layer(7, n=1024, d=128))
    mask_gpu, (bq, bk) = mw.mala_masks_cuda(q, k, v, 1.0)
    mask_cpu = mw.mala_masks(q, k, v, 1.0, bq, bk, CLI)
    assert mask_gpu.shape == mask_cpu.shape and (mask_gpu > 0).equal(mask_cpu > 0)
    legal = int((mask_cpu > 0).sum())
    assert int((mask_gpu != mask_cpu).sum()) <= max(2, legal // 200)
    keep = {"mala": mask_cpu == 2}
    cpu = mw.Instance((0, 0), q, k, v, bq, bk).evaluate(keep)["mala"]
    gpu = mw.Instance((0, 0), q, k, v, bq, bk, device="cuda").evaluate(keep)["mala"]
    for a, b in zip(cpu, gpu):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)

"""mala.attention_with_kvcache: decode against contiguous and paged caches, in-place append, CUDA graphs,
split rules, and no host synchronization unless check_inputs=True."""

import os
import subprocess
import sys

import pytest
import torch

import mala
from conftest import HAS_CUDA, device_params, dtype_for, local_inputs, rand, reference_attention, rel_l2
from mala.flash_attn_interface import flash_attn_with_kvcache


def _cache_case(device, batch=3, capacity=700, hq=8, hkv=2, d=128, seqlen_q=1, seqlen_new=1, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = dtype_for(device)
    k_cache = rand((batch, capacity, hkv, d), device, dtype)
    v_cache = rand((batch, capacity, hkv, d), device, dtype)
    lengths = torch.randint(1, capacity - seqlen_new, (batch,), generator=g, dtype=torch.int32)
    lengths[0] = capacity - seqlen_new  # one full cache
    cache_seqlens = lengths.to(device)
    q = rand((batch, seqlen_q, hq, d), device, dtype)
    k_new = rand((batch, seqlen_new, hkv, d), device, dtype) if seqlen_new else None
    v_new = rand((batch, seqlen_new, hkv, d), device, dtype) if seqlen_new else None
    return q, k_cache, v_cache, cache_seqlens, k_new, v_new


def _dense_per_sequence(q, k_cache, v_cache, cache_seqlens, seqlen_new, causal=True):
    """The reference: each sequence's cache prefix (after the append), dense, bottom-right causal."""
    outs = []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b]) + seqlen_new
        out, _ = reference_attention(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal)
        outs.append(out)
    return torch.cat(outs)


def _to_paged(k_cache, v_cache, page_size, seed=0):
    """Scatter a contiguous cache into shuffled pages; returns paged caches and the block table."""
    batch, capacity, hkv, d = k_cache.shape
    pages_per_seq = capacity // page_size
    num_pages = batch * pages_per_seq + 3  # a few unused pages
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[: batch * pages_per_seq]
    block_table = perm.view(batch, pages_per_seq).to(torch.int32).to(k_cache.device)
    k_paged = torch.zeros((num_pages, page_size, hkv, d), dtype=k_cache.dtype, device=k_cache.device)
    v_paged = torch.zeros_like(k_paged)
    k_paged[block_table.long().flatten()] = k_cache.reshape(batch * pages_per_seq, page_size, hkv, d)
    v_paged[block_table.long().flatten()] = v_cache.reshape(batch * pages_per_seq, page_size, hkv, d)
    return k_paged, v_paged, block_table


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_decode_matches_dense_and_appends(device, seqlen_q, num_splits):
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = _cache_case(device, seqlen_q=seqlen_q, seqlen_new=seqlen_q)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new, tau=0.0,
                                           num_splits=num_splits, return_lse=True)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], seqlen_q)
    # The new keys/values were written at cache_seqlens[b]; nothing else changed.
    expected_k, expected_v = k_before.clone(), v_before.clone()
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        expected_k[b, n:n + seqlen_q] = k_new[b]
        expected_v[b, n:n + seqlen_q] = v_new[b]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    ref = _dense_per_sequence(q, k_cache, v_cache, cache_seqlens, seqlen_q)
    assert rel_l2(out, ref) < 1e-2


@pytest.mark.parametrize("device", device_params())
def test_decode_tau1_within_bound_without_append(device):
    """Without k/v the cache is read only; tau = 1 stays within the bound of the dense answer."""
    q, k_cache, v_cache, cache_seqlens, _, _ = _cache_case(device, seqlen_q=1, seqlen_new=0, seed=1)
    k_before = k_cache.clone()
    out, lse, stats = mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, tau=1.0, return_lse=True,
                                                  return_stats=True)
    assert torch.equal(k_cache, k_before)
    _, lse_dense = mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, tau=0.0, return_lse=True)
    omitted = 1 - torch.exp(lse - lse_dense)
    assert omitted.max().item() <= 0.5 + 2e-2 and omitted.min().item() > -2e-2
    assert stats.fwd_slots.shape == (q.shape[0], q.shape[2], 1)
    assert 0.0 < stats.fwd_retained_fraction <= 1.0 and stats.num_splits >= 1


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("page_size", [64, 256])
def test_paged_cache_equals_contiguous(device, page_size):
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = _cache_case(device, capacity=768, seqlen_new=1, seed=2)
    k_paged, v_paged, block_table = _to_paged(k_cache, v_cache, page_size)
    out_paged = mala.attention_with_kvcache(q, k_paged, v_paged, cache_seqlens, k=k_new, v=v_new,
                                            block_table=block_table, tau=0.0)
    out = mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new, tau=0.0)
    torch.testing.assert_close(out_paged, out, atol=2e-2 if q.dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    # The append went into the right pages.
    b, n = 1, int(cache_seqlens[1])
    page, slot = block_table[b, n // page_size].item(), n % page_size
    assert torch.equal(k_paged[page, slot], k_new[b, 0]) and torch.equal(v_paged[page, slot], v_new[b, 0])


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_cuda_graph_capture_and_replay():
    """A decode step captured once and replayed with new q, k/v and cache lengths."""
    device = "cuda"
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = _cache_case(device, seqlen_new=1, seed=3)
    capacity = k_cache.shape[1]
    static = dict(q=q.clone(), k=k_new.clone(), v=v_new.clone(), lens=cache_seqlens.clamp(max=capacity - 8))

    def step():
        return mala.attention_with_kvcache(static["q"], k_cache, v_cache, static["lens"], k=static["k"],
                                           v=static["v"], tau=1.0)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the graph
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for i in range(3):
        new_q = rand(q.shape, device, q.dtype)
        new_k, new_v = rand(k_new.shape, device, q.dtype), rand(v_new.shape, device, q.dtype)
        static["q"].copy_(new_q)
        static["k"].copy_(new_k)
        static["v"].copy_(new_v)
        static["lens"].add_(1)
        graph.replay()
        torch.cuda.synchronize()
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        eager = mala.attention_with_kvcache(new_q, k_eager, v_eager, static["lens"], k=new_k, v=new_v, tau=1.0)
        torch.testing.assert_close(static_out, eager, atol=0, rtol=0)
        assert torch.equal(k_cache, k_eager), f"replay {i}: the graph must append into the cache like eager"


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_cuda_first_call_inside_graph_capture():
    """A process whose very first decode call is captured: the per-device facts (attributes, the
    kernel's shared-memory opt-in) are set up under capture, and the replay matches an eager call."""
    script = """
import torch, mala
torch.manual_seed(0)
q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 4096, 1, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
lens = torch.tensor([4000, 1234], dtype=torch.int32, device="cuda")
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_out = {tau0: mala.attention_with_kvcache(q, k, v, lens, tau=tau0, num_splits=8) for tau0 in (0.0, 1.0)}
graph.replay()
torch.cuda.synchronize()
for tau0, out in static_out.items():
    assert torch.equal(out, mala.attention_with_kvcache(q, k, v, lens, tau=tau0, num_splits=8)), tau0
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_cuda_decode_returns_its_scratch():
    """The split-KV partials live in scratch memory of the call alone: once the outputs are dropped,
    PyTorch's allocator holds what it held before."""
    q, k_cache, v_cache, cache_seqlens, _, _ = _cache_case("cuda", seqlen_new=0, seed=7)
    mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, num_splits=4)  # first-call setup
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, lse = mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, num_splits=4, return_lse=True)
    assert torch.cuda.memory_allocated() > before
    del out, lse
    assert torch.cuda.memory_allocated() == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_decode_on_every_device():
    """Per-device setup (the split kernel's shared-memory opt-in, the device attributes): the same
    call gives the same answer on every device, whichever device is current."""
    q, k_cache, v_cache, cache_seqlens, _, _ = _cache_case("cuda", seqlen_new=0, seed=8)
    ref = {tau: mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, tau=tau, num_splits=4).cpu()
           for tau in (0.0, 1.0)}
    for dev in range(1, torch.cuda.device_count()):
        args = [t.to(f"cuda:{dev}") for t in (q, k_cache, v_cache, cache_seqlens)]
        for tau, expected in ref.items():
            with torch.cuda.device(0):  # the operator switches to the tensors' device
                out = mala.attention_with_kvcache(*args, tau=tau, num_splits=4)
            assert out.device == args[0].device
            torch.testing.assert_close(out.cpu(), expected, atol=2e-2, rtol=1e-2)  # devices may differ in kind


# ---- split_rule (issue 29): per_split, the paper's rule, and seeded ------------------------------

def _recency_cache(batch=2, n=4096, hq=8, hkv=2, d=64, seed=4):
    """A 4K CPU cache whose last query attends to recent keys (local_inputs' positional code): the
    unsplit rule keeps a few tiles; far splits hold little mass of their own."""
    q, k, v = local_inputs("cpu", batch, n, hq, hkv, d, sharpness=2.0, seed=seed)
    return q[:, -1:].contiguous(), k, v, torch.full((batch,), n, dtype=torch.int32)


def test_seeded_one_split_equals_per_split():
    q, k_cache, v_cache, lens = _recency_cache(n=1024)
    results = {}
    for rule in ("per_split", "seeded"):
        results[rule] = mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=1.0, num_splits=1, return_lse=True,
                                                    return_stats=True, split_rule=rule)
    (out_p, lse_p, st_p), (out_s, lse_s, st_s) = results["per_split"], results["seeded"]
    assert torch.equal(out_s, out_p) and torch.equal(lse_s, lse_p)
    assert torch.equal(st_s.fwd_slots, st_p.fwd_slots) and st_s.num_splits == st_p.num_splits == 1
    assert st_p.fwd_retained_fraction < 0.5  # the case skips tiles, so the comparison means something


@pytest.mark.parametrize("num_splits", [4, 32])
def test_seeded_splits_retain_less_within_bound(num_splits):
    tau = 1.0
    q, k_cache, v_cache, lens = _recency_cache()
    _, lse_dense = mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=0.0, num_splits=1, return_lse=True)
    _, _, one = mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau, num_splits=1, return_lse=True,
                                            return_stats=True)
    fractions = {}
    for rule in ("per_split", "seeded"):
        out, lse, stats = mala.attention_with_kvcache(q, k_cache, v_cache, lens, tau=tau, num_splits=num_splits,
                                                      return_lse=True, return_stats=True, split_rule=rule)
        assert stats.num_splits == num_splits
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        omitted = 1 - torch.exp(lse.double() - lse_dense.double())
        assert omitted.max().item() <= tau / (1 + tau) + 1e-4, f"{rule}: omitted mass {omitted.max().item():.4f}"
        assert omitted.min().item() > -1e-4
        fractions[rule] = stats.fwd_retained_fraction
    # per_split: far splits keep nearly everything; seeded keeps about what one split keeps (plus tile 0).
    assert fractions["seeded"] < fractions["per_split"], fractions
    assert fractions["seeded"] <= one.fwd_retained_fraction + 2 * 128 / 4096 + 1e-9, (fractions, one)


def test_split_rule_argument_errors():
    q, k_cache, v_cache, lens = _recency_cache(batch=1, n=256)
    for bad in ("Seeded", "", "per-split", None, 1):
        with pytest.raises(ValueError, match="^split_rule:"):
            mala.attention_with_kvcache(q, k_cache, v_cache, lens, split_rule=bad)
    with pytest.raises(ValueError, match="^split_rule:"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, split_rule="bogus")
    # The operator checks it too (what torch.ops.mala.kvcache callers get).
    with pytest.raises(ValueError, match="split_rule"):
        torch.ops.mala.kvcache(q, k_cache, v_cache, lens, None, None, None, 1.0, True, 0.0, 2, False, "bogus")
    # The flash_attn shim passes it through.
    ref = mala.attention_with_kvcache(q, k_cache, v_cache, lens, num_splits=2, split_rule="seeded", causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=2,
                                  split_rule="seeded")
    assert torch.equal(out, ref)


def test_split_rule_default_is_seeded():
    q, k_cache, v_cache, lens = _recency_cache(n=1024)
    ref = mala.attention_with_kvcache(q, k_cache, v_cache, lens, num_splits=8, split_rule="seeded")
    assert torch.equal(mala.attention_with_kvcache(q, k_cache, v_cache, lens, num_splits=8), ref)
    assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, num_splits=8), ref)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 4, 32])
def test_cuda_split_rules_match_cpu(num_splits):
    """The CUDA kernels implement both rules: the same retained fraction as the CPU (the same tiles up
    to rounding flips), the output within bf16 tolerance, the omitted mass within the bound; with one
    split both rules are the forward rule, bit for bit."""
    tau = 1.0
    q, k_cache, v_cache, lens = _recency_cache(n=4096, d=128)
    qc, kc, vc = (t.to("cuda", torch.bfloat16) for t in (q, k_cache, v_cache))
    q32, k32, v32 = (t.to(torch.bfloat16).float() for t in (q, k_cache, v_cache))
    _, lse_dense = mala.attention_with_kvcache(q32, k32, v32, lens, tau=0.0, num_splits=1, return_lse=True)
    results = {}
    for rule in ("seeded", "per_split"):
        out, lse, stats = mala.attention_with_kvcache(qc, kc, vc, lens.cuda(), tau=tau, num_splits=num_splits,
                                                      return_lse=True, return_stats=True, split_rule=rule)
        ref, ref_lse, ref_stats = mala.attention_with_kvcache(q32, k32, v32, lens, tau=tau, num_splits=num_splits,
                                                              return_lse=True, return_stats=True, split_rule=rule)
        assert stats.num_splits == ref_stats.num_splits == num_splits
        assert abs(stats.fwd_retained_fraction - ref_stats.fwd_retained_fraction) <= 0.01, (rule, stats, ref_stats)
        torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-2, rtol=1e-3)
        omitted = 1 - torch.exp(lse.cpu().double() - lse_dense.double())
        assert omitted.max().item() <= tau / (1 + tau) + 1e-3, (rule, omitted.max().item())
        results[rule] = (out, lse)
    if num_splits == 1:
        assert torch.equal(results["seeded"][0], results["per_split"][0])
        assert torch.equal(results["seeded"][1], results["per_split"][1])


# ---- check_inputs: no host synchronization unless asked -----------------------------------------

class _HostCopy(Exception):
    pass


def _forbid_host_copies(monkeypatch):
    """Make every Tensor -> Python value conversion raise, so a test fails if the call reads a tensor
    on the host (what a device -> host copy would be on CUDA)."""
    def refuse(*args, **kwargs):
        raise _HostCopy("host copy of a tensor")
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("paged", [False, True])
def test_default_call_does_not_read_indices_on_host(device, paged, monkeypatch):
    q, k_cache, v_cache, cache_seqlens, k_new, v_new = _cache_case(device, capacity=512, seqlen_new=1, seed=6)
    block_table = None
    if paged:
        k_cache, v_cache, block_table = _to_paged(k_cache, v_cache, 64)
    args = (q, k_cache, v_cache, cache_seqlens)
    kwargs = dict(k=k_new, v=v_new, block_table=block_table)
    _forbid_host_copies(monkeypatch)
    out = mala.attention_with_kvcache(*args, **kwargs)
    out_fa = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table)
    assert out.shape == out_fa.shape == q.shape
    # The spy works: the opt-in check reads cache_seqlens on the host.
    with pytest.raises(_HostCopy):
        mala.attention_with_kvcache(*args, check_inputs=True, **kwargs)


@pytest.mark.parametrize("device", device_params())
def test_check_inputs_true_still_validates(device):
    dtype = dtype_for(device)
    q = rand((2, 1, 4, 64), device, dtype)
    k_cache, v_cache = rand((2, 100, 2, 64), device, dtype), rand((2, 100, 2, 64), device, dtype)
    f = mala.attention_with_kvcache
    for bad in ([10, 101], [-1, 5]):
        lens = torch.tensor(bad, dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match="^cache_seqlens:"):
            f(q, k_cache, v_cache, lens, check_inputs=True)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="^block_table:"):
        f(q, k_cache, v_cache, lens, block_table=torch.tensor([[0], [5]], dtype=torch.int32, device=device),
          check_inputs=True)


# ---- the eager call's direct path (mala._C.kvcache_direct) -----------------------------------------

def _direct_args(q, k_cache, v_cache, lens, k=None, v=None, tau=1.0, num_splits=0, return_lse=True):
    return (q, k_cache, v_cache, lens, k, v, None, tau, True, 0.0, num_splits, "seeded", return_lse)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("num_splits", [0, 3])
def test_direct_path_matches_the_operator(device, num_splits):
    """The eager path without the dispatcher returns what torch.ops.mala.kvcache returns, bit for bit,
    appends the same keys, and bumps the caches' versions as the operator's mutation annotation does."""
    q, k_cache, v_cache, lens, k_new, v_new = _cache_case(device, seqlen_q=2, seqlen_new=2, seed=5)
    k2, v2 = k_cache.clone(), v_cache.clone()
    version = k_cache._version
    out, lse = mala._C.kvcache_direct(*_direct_args(q, k_cache, v_cache, lens, k_new, v_new, num_splits=num_splits))
    assert k_cache._version > version and v_cache._version > 0
    ref_out, ref_lse, slots = torch.ops.mala.kvcache(q, k2, v2, lens, k_new, v_new, None, 1.0, True, 0.0, num_splits,
                                                     False, "seeded")
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and slots.numel() == 0
    only_out = mala._C.kvcache_direct(*_direct_args(q, k_cache, v_cache, lens, num_splits=num_splits,
                                                    return_lse=False))
    assert isinstance(only_out, torch.Tensor) and only_out.shape == q.shape
    # The public call takes this path and returns the same.
    pub = mala.attention_with_kvcache(q, k_cache, v_cache, lens, num_splits=num_splits)
    assert torch.equal(pub, only_out)


class _CountingMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("device", device_params())
def test_direct_path_defers_to_the_dispatcher(device):
    """Where the dispatcher would act (a dispatch mode, a tensor subclass) the direct path declines
    and the public call runs the operator, which the mode then sees."""
    q, k_cache, v_cache, lens, _, _ = _cache_case(device, seqlen_new=0, seed=6)
    expected = mala.attention_with_kvcache(q, k_cache, v_cache, lens)
    mode = _CountingMode()
    with mode:
        assert mala._C.kvcache_direct(*_direct_args(q, k_cache, v_cache, lens)) is NotImplemented
        out = mala.attention_with_kvcache(q, k_cache, v_cache, lens)
    assert any("mala.kvcache" in op for op in mode.ops)
    assert torch.equal(out, expected)
    sub = q.as_subclass(_Subclass)
    assert mala._C.kvcache_direct(*_direct_args(sub, k_cache, v_cache, lens)) is NotImplemented


@pytest.mark.parametrize("device", device_params())
def test_direct_path_appends_to_inference_tensors(device):
    """Caches made under torch.inference_mode (no version counter) take the appended keys too."""
    with torch.inference_mode():
        q, k_cache, v_cache, lens, k_new, v_new = _cache_case(device, seqlen_new=1, seed=8)
        out = mala.attention_with_kvcache(q, k_cache, v_cache, lens, k=k_new, v=v_new, tau=0.0)
    n = int(lens[0])
    assert torch.equal(k_cache[0, n], k_new[0, 0]) and torch.equal(v_cache[0, n], v_new[0, 0])
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("device", device_params())
def test_direct_path_errors_name_the_argument(device):
    """The direct path runs the operator's checks: the same errors, and nothing written."""
    q, k_cache, v_cache, lens, k_new, v_new = _cache_case(device, seqlen_new=1, seed=7)
    before = k_cache.clone()
    with pytest.raises(TypeError, match="cache_seqlens: dtype must be int32"):
        mala.attention_with_kvcache(q, k_cache, v_cache, lens.long(), k=k_new, v=v_new)
    with pytest.raises(ValueError, match="k_cache: head_dim"):
        mala.attention_with_kvcache(q, k_cache[..., :64].contiguous(), v_cache[..., :64].contiguous(), lens)
    with pytest.raises(TypeError, match="split_rule"):
        mala._C.kvcache_direct(q, k_cache, v_cache, lens, None, None, None, 1.0, True, 0.0, 0, 7, False)
    with pytest.raises(TypeError, match="13 positional"):
        mala._C.kvcache_direct(q, k_cache)
    assert torch.equal(k_cache, before)

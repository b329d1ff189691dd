"""The attention implementations the suite runs side by side, behind one small interface.

Every system takes the suite's inputs (bf16, [B, N, H, d] as flash_attn) and prepares its own
layout once, outside the timed region (SDPA and FlexAttention get contiguous [B, H, N, d] copies;
the cuDNN SDPA backend gets K/V expanded to Hq heads, as the anchors in docs/benchmarks.md did, because
it takes no GQA there).  The timed callables then call the kernel alone.

    sys.prepare(q, k, v, dout) -> Prepared with .fwd(), .make_graph() -> .bwd(), .fwd_bwd()
    sys.prepare_decode(q, k_cache, v_cache) -> Prepared with .decode()
    sys.outputs(...) -> (out [B, N, Hq, d], lse [B, Hq, N] or None)   (correctness and omitted mass)

A system that cannot run raises Unsupported(reason) (recorded as such, never dropped).
"""

from __future__ import annotations

import math
import os
import sys
import types
from typing import Optional

import torch
import torch.nn.functional as F


class Unsupported(Exception):
    """This system cannot run this operator/shape (the message says why)."""


def _bhnd(x):
    return x.transpose(1, 2).contiguous()


def _bnhd(x):
    return x.transpose(1, 2)


class Prepared:
    """Tensors in the system's layout plus the callables the timer runs."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class System:
    name = "?"
    label = "?"
    tau: Optional[float] = None      # None: dense (no tolerance)
    sparse = False                   # reports omitted mass (tau > 0 capable)

    def available(self) -> Optional[str]:
        """None when usable, else the reason it is not."""
        return None

    # ---- training-shape operators ------------------------------------------------------------
    def attn(self, q, k, v):
        """Forward in the system's own layout, autograd-capable."""
        raise NotImplementedError

    def to_layout(self, x, is_kv=False, heads_q=None):
        return x

    def from_layout(self, o):
        return o

    def prepare(self, q, k, v, dout, need_grad=True):
        Hq = q.shape[2]
        qs = self.to_layout(q).detach()
        ks = self.to_layout(k, True, Hq).detach()
        vs = self.to_layout(v, True, Hq).detach()
        ds = self.to_layout(dout).detach() if dout is not None else None
        p = Prepared(q=qs, k=ks, v=vs, dout=ds)

        def fwd():
            with torch.no_grad():
                return self.attn(qs, ks, vs)

        p.fwd = fwd
        if need_grad:
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (qs, ks, vs))
            p.qg, p.kg, p.vg = qg, kg, vg

            def make_graph():
                p.out_graph = self.attn(qg, kg, vg)

            def bwd():
                return torch.autograd.grad(p.out_graph, (qg, kg, vg), ds, retain_graph=True)

            def fwd_bwd():
                o = self.attn(qg, kg, vg)
                return torch.autograd.grad(o, (qg, kg, vg), ds)

            def bwd_once():
                return torch.autograd.grad(p.out_graph, (qg, kg, vg), ds)

            p.make_graph, p.bwd, p.bwd_once, p.fwd_bwd = make_graph, bwd, bwd_once, fwd_bwd
        return p

    def grads_in_bnhd(self, grads, heads_kv):
        """(dq, dk, dv) back in [B, N, H, d] with dk/dv reduced to heads_kv heads."""
        dq, dk, dv = (self.from_layout(g) for g in grads)
        if dk.shape[2] != heads_kv:
            B, N, H, d = dk.shape
            dk = dk.float().view(B, N, heads_kv, H // heads_kv, d).sum(3)
            dv = dv.float().view(B, N, heads_kv, H // heads_kv, d).sum(3)
        return dq, dk, dv

    def outputs(self, q, k, v):
        """(out [B, N, Hq, d], lse [B, Hq, N] fp32 or None) for the checks."""
        with torch.no_grad():
            p = self.prepare(q, k, v, None, need_grad=False)
            return self.from_layout(p.fwd()), None

    def stats(self, q, k, v, dout):
        """Realized work (MALA only): dict or None."""
        return None

    # ---- decode -----------------------------------------------------------------------------
    def prepare_decode(self, q, k_cache, v_cache):
        raise Unsupported("no decode path")


# ---- torch SDPA ---------------------------------------------------------------------------------

class SDPA(System):
    def __init__(self, backend: str):
        from torch.nn.attention import SDPBackend
        self.backend_name = backend
        self.backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
        self.name = f"sdpa_{backend}"
        self.label = {"flash": "SDPA flash (FA2)", "cudnn": "SDPA cuDNN"}[backend]
        self.expand_kv = backend == "cudnn"

    def to_layout(self, x, is_kv=False, heads_q=None):
        x = _bhnd(x)
        if is_kv and self.expand_kv and heads_q != x.shape[1]:
            x = x.repeat_interleave(heads_q // x.shape[1], dim=1).contiguous()
        return x

    def from_layout(self, o):
        return _bnhd(o)

    def _call(self, q, k, v, causal):
        from torch.nn.attention import sdpa_kernel
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel([self.backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def attn(self, q, k, v):
        return self._call(q, k, v, True)

    def prepare_decode(self, q, k_cache, v_cache):
        Hq = q.shape[2]
        qs, ks, vs = _bhnd(q), self.to_layout(k_cache, True, Hq), self.to_layout(v_cache, True, Hq)

        def decode():
            with torch.no_grad():
                return self._call(qs, ks, vs, False)  # one query row sees the whole cache

        return Prepared(decode=decode, q=qs, k=ks, v=vs,
                        out=lambda: _bnhd(decode()))


# ---- FlashAttention-4 (CuTe DSL; PyPI flash-attn-4) -----------------------------------------------

def load_fa4():
    """flash_attn.cute.flash_attn_func, or Unsupported with the reason.  Installed with pip --target,
    nvidia-cutlass-dsl's .pth hook (which puts its dsl_packages on sys.path) is not applied: do it here."""
    try:
        import nvidia_cutlass_dsl
        dsl = os.path.join(nvidia_cutlass_dsl.__path__[0], "dsl_packages")
        if dsl not in sys.path:
            sys.path.insert(0, dsl)
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to record
        raise Unsupported(f"flash-attn-4 not importable: {type(e).__name__}: {e}")
    return flash_attn_func


class FA4(System):
    """FlashAttention-4 (flash_attn.cute, CuTe DSL kernels with an sm_90 forward and backward), GQA
    native, flash_attn's [B, N, H, d] layout.  Its kernels compile on first use (JIT), so the suite's
    warm-up calls absorb that."""

    name = "fa4"
    label = "FlashAttention-4"

    def __init__(self):
        self._fn = None

    def available(self):
        try:
            self._fn = load_fa4()
        except Unsupported as e:
            return str(e)
        return None

    def attn(self, q, k, v):
        if self._fn is None:
            self._fn = load_fa4()
        out = self._fn(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def outputs(self, q, k, v):
        with torch.no_grad():
            if self._fn is None:
                self._fn = load_fa4()
            out, lse = self._fn(q, k, v, causal=True, return_lse=True)[:2]
            return out, lse.float()


# ---- FlexAttention ------------------------------------------------------------------------------

_FLEX = {}


def _flex_compiled():
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        # One compiled graph per sequence length (fwd and bwd); keep them all instead of falling
        # back to the eager (N^2-memory) path after the default limit of 8.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, 4096)
        dynamic = os.environ.get("MALA_BENCH_FLEX_DYNAMIC", "0") == "1"
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX["fn"]


def causal_block_mask(n: int, device, block: int = 128):
    """The causal BlockMask create_block_mask(q >= kv) builds, constructed from its block lists
    directly: creating it through create_block_mask materializes an N x N mask (it ran out of memory
    at 128K in the anchors' first try).  Diagonal blocks are partial (masked), the rest full."""
    from torch.nn.attention.flex_attention import BlockMask
    nb = (n + block - 1) // block
    ar = torch.arange(nb, device=device, dtype=torch.int32)
    kv_num = torch.ones(1, 1, nb, dtype=torch.int32, device=device)
    # partial list: the diagonal block first (the rest of each row is ignored by the kernel)
    kv_idx = ((ar[:, None] + ar[None, :]) % nb).to(torch.int32).view(1, 1, nb, nb)
    full_num = ar.clone().view(1, 1, nb)
    full_idx = ar[None, :].expand(nb, nb).contiguous().view(1, 1, nb, nb)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=causal, seq_lengths=(n, n))


class Flex(System):
    name = "flex"
    label = "FlexAttention (compiled)"

    def __init__(self):
        self._masks = {}

    def to_layout(self, x, is_kv=False, heads_q=None):
        return _bhnd(x)

    def from_layout(self, o):
        return _bnhd(o)

    def _mask(self, n, device):
        if n not in self._masks:
            self._masks[n] = causal_block_mask(n, device)
        return self._masks[n]

    def attn(self, q, k, v):
        fn = _flex_compiled()
        return fn(q, k, v, block_mask=self._mask(q.shape[2], q.device), enable_gqa=q.shape[1] != k.shape[1])

    def prepare_decode(self, q, k_cache, v_cache):
        qs, ks, vs = _bhnd(q), _bhnd(k_cache), _bhnd(v_cache)
        fn = _flex_compiled()

        def decode():
            with torch.no_grad():
                return fn(qs, ks, vs, enable_gqa=qs.shape[1] != ks.shape[1])

        return Prepared(decode=decode, out=lambda: _bnhd(decode()))


# ---- flash-sparse-attn (the paper's implementation, Triton) -------------------------------------

_FSA = {}


def _stub_triton_kernels():
    """flash_sparse_attn's interface module imports its fused-projection ops at import time, and
    those import the `triton_kernels` package (not on the GPU image, not used by the attention
    functions).  When it is missing, register empty placeholder modules so the import succeeds;
    the projection ops are never called by the suite."""
    try:
        import triton_kernels.matmul_ogs  # noqa: F401
        import triton_kernels.numerics  # noqa: F401
        return False
    except Exception:
        pass
    pkg = types.ModuleType("triton_kernels")
    pkg.__path__ = []
    mm = types.ModuleType("triton_kernels.matmul_ogs")
    nm = types.ModuleType("triton_kernels.numerics")
    for name in ("matmul_ogs", "PrecisionConfig", "FlexCtx"):
        setattr(mm, name, None)
    for name in ("InFlexData", "OutFlexData"):
        setattr(nm, name, None)
    pkg.matmul_ogs, pkg.numerics = mm, nm
    sys.modules.update({"triton_kernels": pkg, "triton_kernels.matmul_ogs": mm,
                        "triton_kernels.numerics": nm})
    return True


# The library autotunes every kernel over 54 Triton configs per (sequence-length bucket), which
# alone would take most of a 10-minute device call.  By default the suite restricts each search to
# the configs below (the same knobs, the sizes that suit H100/H200 with d = 128);
# MALA_BENCH_FSA_TUNE=full restores the library's own search space.
def _reduced_configs(kind):
    import triton
    if kind == "fwd":
        grid = [(128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
                (128, 32, 4, 3)]
    elif kind == "bwd":
        grid = [(64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (128, 128, 8, 1), (64, 64, 4, 2)]
    else:  # decode
        grid = [(16, 128, 4, 2), (16, 64, 4, 3), (16, 256, 8, 2), (32, 128, 4, 2), (64, 128, 4, 2)]
    return [triton.Config({"TILE_M": m, "TILE_N": n}, num_warps=w, num_stages=s, num_ctas=1)
            for m, n, w, s in grid]


def load_fsa():
    if "mod" in _FSA:
        return _FSA["mod"]
    try:
        stubbed = _stub_triton_kernels()
        import flash_sparse_attn
        from flash_sparse_attn.ops.triton import autotuner
        if os.environ.get("MALA_BENCH_FSA_TUNE", "reduced") != "full":
            autotuner.get_fwd_sparse_autotune_configs = lambda tile_n=None: [
                c for c in _reduced_configs("fwd") if tile_n is None or c.kwargs["TILE_N"] == tile_n] \
                or _reduced_configs("fwd")
            autotuner.get_bwd_sparse_autotune_configs = lambda: _reduced_configs("bwd")
            autotuner.get_dec_sparse_autotune_configs = lambda tile_n=None: _reduced_configs("dec")
        _FSA["mod"] = flash_sparse_attn
        _FSA["stubbed"] = stubbed
        _FSA["version"] = getattr(flash_sparse_attn, "__version__", "?")
        _FSA["tune"] = os.environ.get("MALA_BENCH_FSA_TUNE", "reduced")
    except Exception as e:  # noqa: BLE001
        _FSA["mod"] = None
        _FSA["error"] = f"{type(e).__name__}: {e}"
    return _FSA["mod"]


class FlashSparseAttn(System):
    """flash_sparse_attn.flash_sparse_attn_func(q, k, v, is_causal=True, softmax_threshold=tau).

    Its threshold maps to MALA's tau one to one: the kernel skips a tile when, for every row,
    max_j s - m - log(l) < log(min(softmax_threshold / L_q, 1)) with L_q the row's visible keys
    (ops/triton/seqlen_info.py get_softmax_threshold, activations.py online_sparse_softmax), i.e.
    the same tau / L_q test; softmax_threshold = 0 gives log(0) = -inf: nothing skipped.  Its tiles
    are its own (autotuned), so its retained set differs from MALA's 128 x 128 tiles."""

    sparse = True

    def __init__(self, tau: float):
        self.tau = float(tau)
        self.name = f"fsa_tau{self.tau:g}"
        self.label = f"flash-sparse-attn tau={self.tau:g}"

    def available(self):
        if load_fsa() is None:
            return "flash_sparse_attn not importable: " + _FSA.get("error", "?")
        return None

    def attn(self, q, k, v):
        return _FSA["mod"].flash_sparse_attn_func(q, k, v, is_causal=True, softmax_threshold=self.tau)

    def outputs(self, q, k, v):
        with torch.no_grad():
            out, lse = _FSA["mod"].flash_sparse_attn_func(q, k, v, is_causal=True,
                                                          softmax_threshold=self.tau, return_lse=True)
        return out, lse

    def prepare_decode(self, q, k_cache, v_cache):
        fn = _FSA["mod"].flash_sparse_attn_with_kvcache_func
        q3 = q[:, 0].contiguous()  # [B, Hq, d]

        def decode():
            with torch.no_grad():
                return fn(q3, k_cache, v_cache, softmax_threshold=self.tau)

        def out():
            return decode().unsqueeze(1)

        def out_lse():
            with torch.no_grad():
                o, lse = fn(q3, k_cache, v_cache, softmax_threshold=self.tau, return_lse=True)
            return o.unsqueeze(1), lse.unsqueeze(-1)

        return Prepared(decode=decode, out=out, out_lse=out_lse)


# ---- mala ---------------------------------------------------------------------------------------

_MALA = {}


def load_mala():
    if "mod" in _MALA:
        return _MALA["mod"]
    try:
        import mala
        _MALA["mod"] = mala
        _MALA["version"] = getattr(mala, "__version__", "?")
        _MALA["file"] = getattr(mala, "__file__", "?")
    except Exception as e:  # noqa: BLE001
        _MALA["mod"] = None
        _MALA["error"] = f"{type(e).__name__}: {e}"
    return _MALA["mod"]


class Mala(System):
    sparse = True

    def __init__(self, tau: float, deterministic: bool = False):
        self.tau = float(tau)
        self.deterministic = bool(deterministic)  # the backward's deterministic mode
        self.name = f"mala_tau{self.tau:g}" + ("_det" if deterministic else "")
        self.label = f"MALA tau={self.tau:g}" + (", deterministic" if deterministic else "")

    def available(self):
        if load_mala() is None:
            return "mala not importable: " + _MALA.get("error", "?")
        return None

    def attn(self, q, k, v):
        return _MALA["mod"].attention(q, k, v, tau=self.tau, causal=True, deterministic=self.deterministic)

    def outputs(self, q, k, v):
        with torch.no_grad():
            return _MALA["mod"].attention(q, k, v, tau=self.tau, causal=True, return_lse=True)

    def stats(self, q, k, v, dout):
        """Realized work of one forward + backward with return_stats (not timed)."""
        m = _MALA["mod"]
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out, lse, st = m.attention(qg, kg, vg, tau=self.tau, causal=True, return_lse=True, return_stats=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)
        res = {
            "fwd_slots_mean": st.mean_fwd_slots,
            "bwd_slots_mean": st.mean_bwd_slots,
            "fwd_retained_fraction": st.fwd_retained_fraction,
            "bwd_retained_fraction": st.bwd_retained_fraction,
            "fwd_tiles": [st.fwd_block_q, st.fwd_block_k],
            "bwd_tiles": [st.bwd_block_q, st.bwd_block_k],
        }
        return res, lse.detach()

    def prepare_decode(self, q, k_cache, v_cache):
        m = _MALA["mod"]
        B, N = k_cache.shape[0], k_cache.shape[1]
        seqlens = torch.full((B,), N, dtype=torch.int32, device=q.device)

        def decode():
            return m.attention_with_kvcache(q, k_cache, v_cache, seqlens, tau=self.tau, causal=True,
                                            check_inputs=False)

        def out_lse():
            o, lse = m.attention_with_kvcache(q, k_cache, v_cache, seqlens, tau=self.tau, causal=True,
                                              return_lse=True)
            return o, lse

        def stats():
            _, st = m.attention_with_kvcache(q, k_cache, v_cache, seqlens, tau=self.tau, causal=True,
                                             return_stats=True)
            return {"fwd_slots_mean": st.mean_fwd_slots, "fwd_retained_fraction": st.fwd_retained_fraction,
                    "num_splits": st.num_splits, "fwd_tiles": [st.fwd_block_q, st.fwd_block_k]}

        return Prepared(decode=decode, out=lambda: decode(), out_lse=out_lse, stats=stats)


# ---- FlashInfer fmha_v2 (NVIDIA skip-softmax, BLASST): lab/suite/fi_system.py ------------------

def flashinfer_system(scale_factor: float):
    import fi_system

    class FlashInfer(fi_system.FlashInferSkipSoftmax, System):
        def __init__(self, sf):
            self.setup(sf)

    return FlashInfer(scale_factor)


def all_systems(names, taus=(1.0,), fi_scale_factors=None):
    """Systems by name: sdpa_flash, sdpa_cudnn, fa4, flex, fsa (at each tau in taus), fsa0, mala
    (at each tau), mala0, flashinfer (fmha_v2 at scale factor 0: the same API, its non-skip
    kernel), flashinfer_skip_softmax (at each of fi_scale_factors; default: the taus)."""
    out = []
    for n in names:
        if n == "sdpa_flash":
            out.append(SDPA("flash"))
        elif n == "sdpa_cudnn":
            out.append(SDPA("cudnn"))
        elif n == "flex":
            out.append(Flex())
        elif n == "fa4":
            out.append(FA4())
        elif n == "fsa":
            out += [FlashSparseAttn(t) for t in taus]
        elif n == "fsa0":
            out.append(FlashSparseAttn(0.0))
        elif n == "mala":
            out += [Mala(t) for t in taus]
        elif n == "mala0":
            out.append(Mala(0.0))
        elif n == "flashinfer":
            out.append(flashinfer_system(0.0))
        elif n == "flashinfer_skip_softmax":
            out += [flashinfer_system(f) for f in (fi_scale_factors or taus)]
        else:
            raise ValueError(f"unknown system {n!r}")
    return out

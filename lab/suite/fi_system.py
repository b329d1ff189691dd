"""NVIDIA's skip-softmax (BLASST) through FlashInfer's fmha_v2 prefill, as a suite system.

    flashinfer.prefill.trtllm_fmha_v2_prefill((q, kv), "CONTIGUOUS_Q_KV", workspace, seq_lens,
        max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size, cu_seqlens_q, cu_seqlens_kv,
        mask_mode="causal", save_softmax_stats=..., skip_softmax_threshold_scale_factor=sf)

(flashinfer-python 0.7.2.post1, flashinfer/prefill.py).  Layout: ragged tokens, q [B*N, Hq, d],
kv [B*N, 2, Hkv, d] (GQA native); causal; bf16.  CONTIGUOUS_Q_KV because it is the layout whose
softmax stats (per row max / sqrt(d) and sum, [tokens, Hq, 2]) the library tests; the stats give
lse = max + log(sum) for bmm1_scale = 1/sqrt(d), and from it the omitted mass.

The rule (data/csrc/fmha_v2/fmha/warpspec/epilogue.h, Softmax::compute_and_update_scale, and
compute.h where skip_softmax_threshold = scale_factor / actual_kv_seqlen): a compute warpgroup's
64 query rows skip the exp and P.V of a 128-key step (bf16, d = 128 on sm_90) when for every row
exp(bmm1_scale * (step_max - running_max)) < scale_factor / N_kv, N_kv the sequence's KV length
(not the row's visible keys).  Key steps run from key 0 upward and the first one is never skipped.
V is still loaded (the compute warps wait on the V buffer before skipping).  The kernel counts
skipped blocks only when built with SKIP_SOFTMAX_STAT, and the API passes no counter buffers, so
the realized sparsity is not reported: blasst_rule() below replays the rule in torch instead, and
the omitted mass is measured from the kernel's lse.  Only the sm_90 warp-specialized kernels are
generated with skip-softmax (fmha_library.py generate_jit_sources); sm_120 kernels are not.
Forward only (no backward).  docs/benchmarks.md ("NVIDIA skip-softmax") maps the knob onto tau.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

STEP_Q, STEP_KV = 64, 128     # the skip unit of the sm_90 bf16 d=128 kernel (fmha_library.py)
WORKSPACE_BYTES = 128 << 20   # as FlashInfer's own tests allocate
_FI = {}


class _Unsupported(Exception):
    pass


def _unsupported():
    try:
        import systems
        return systems.Unsupported
    except Exception:  # noqa: BLE001
        return _Unsupported


# ---- pure functions (CPU-tested) ----------------------------------------------------------------

def to_ragged(q, k, v):
    """Suite inputs [B, N, H, d] -> (q [B*N, Hq, d], kv [B*N, 2, Hkv, d]) contiguous."""
    B, N, Hq, d = q.shape
    Hkv = k.shape[2]
    if k.shape != v.shape or k.shape[:2] != (B, N) or Hq % Hkv:
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    qr = q.reshape(B * N, Hq, d).contiguous()
    kv = torch.stack((k, v), dim=2).reshape(B * N, 2, Hkv, d).contiguous()
    return qr, kv


def from_ragged(o, B, N):
    """Kernel output [B*N, Hq, d] -> [B, N, Hq, d]."""
    return o.view(B, N, o.shape[1], o.shape[2])


def cu_seqlens(B, N, device=None):
    """(seq_lens [B], cum_seq_lens [B + 1]) int32 for B sequences of N tokens."""
    seq = torch.full((B,), N, dtype=torch.int32, device=device)
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=device)
    return seq, cu


def lse_from_stats(stats, B, N, sm_scale, d):
    """Softmax stats [B*N, Hq, 2] (max / sqrt(d), sum) -> lse [B, Hq, N] fp32 (natural log).
    The kernel divides its raw max by sqrt(d); with bmm1_scale = 1/sqrt(d) that is the scaled max."""
    if abs(sm_scale * math.sqrt(d) - 1.0) > 1e-6:
        raise ValueError("lse_from_stats assumes bmm1_scale = 1/sqrt(d)")
    lse = stats[..., 0].float() + torch.log(stats[..., 1].float())
    return lse.view(B, N, -1).permute(0, 2, 1).contiguous()


def threshold(scale_factor, kv_len):
    """The kernel's lambda = scale_factor / N_kv (compute.h); 0 disables skipping."""
    return float(scale_factor) / float(kv_len)


def blasst_skip_test(step_max, running_max, lam, sm_scale):
    """True where exp(sm_scale * (step_max - running_max)) < lam (raw, unscaled scores)."""
    return torch.exp(sm_scale * (step_max - running_max)) < lam


def sf_for_tau(tau, n_kv, visible_keys, l_retained):
    """The scale factor whose per-row threshold equals MALA's: MALA skips when
    exp(s_max - m) < tau * l / L_q, BLASST when exp(s_max - m) < sf / N_kv, so
    sf = tau * l * N_kv / L_q (l = retained sum of exp(s - m) at the test, >= 1)."""
    return float(tau) * float(l_retained) * float(n_kv) / float(visible_keys)


def omitted_bound(scale_factor, visible_keys, n_kv):
    """Upper bound on a row's omitted mass: each skipped key has p < sf / N_kv against the
    retained mass, at most L_q of them, so omitted / retained < sf * L_q / N_kv <= sf."""
    r = float(scale_factor) * float(visible_keys) / float(n_kv)
    return r / (1.0 + r)


@torch.no_grad()
def blasst_rule(q, k, scale_factor, sm_scale=None, step_q=STEP_Q, step_kv=STEP_KV, chunk_rows=4096):
    """Replay of the kernel's skip decisions on [B, N, H, d] inputs (causal, fp32 scores).
    Returns dict(retained_fraction over legal (step_q x step_kv) blocks, omitted_mass per row
    [B, Hq, N] from the retained blocks' lse vs the dense lse)."""
    B, N, Hq, d = q.shape
    g = Hq // k.shape[2]
    sm_scale = sm_scale or 1.0 / math.sqrt(d)
    lam = threshold(scale_factor, N)
    nb = (N + step_kv - 1) // step_kv
    kept = legal = 0
    om = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(Hq):
            kh = k[b, :, h // g].float()
            for r0 in range(0, N, max(step_q, chunk_rows - chunk_rows % step_q)):
                r1 = min(N, r0 + max(step_q, chunk_rows - chunk_rows % step_q))
                s = q[b, r0:r1, h].float() @ kh.T            # raw scores [R, N]
                rows = torch.arange(r0, r1, device=q.device)
                s = s.masked_fill(torch.arange(N, device=q.device)[None, :] > rows[:, None], -math.inf)
                pad = nb * step_kv - N
                sb = torch.nn.functional.pad(s, (0, pad), value=-math.inf).view(r1 - r0, nb, step_kv)
                bmax = sb.amax(-1)                             # [R, nb]
                run = torch.cummax(bmax, dim=1).values         # max over blocks 0..j
                prev = torch.cat([torch.full_like(run[:, :1], -math.inf), run[:, :-1]], 1)
                row_skip = blasst_skip_test(bmax, prev, lam, sm_scale) if lam > 0 else \
                    torch.zeros_like(bmax, dtype=torch.bool)
                row_skip |= ~torch.isfinite(bmax)              # masked-out blocks: no entry
                R = r1 - r0
                grp = row_skip.view(R // step_q, step_q, nb) if R % step_q == 0 else None
                if grp is None:
                    raise ValueError("rows must be a multiple of step_q")
                legal_g = torch.isfinite(bmax).view(R // step_q, step_q, nb).any(1)
                skip_g = grp.all(1) & legal_g
                skip_g[:, 0] = False                           # the first key step is never skipped
                kept += int((legal_g & ~skip_g).sum())
                legal += int(legal_g.sum())
                keep_rows = (~skip_g).repeat_interleave(step_q, 0)[:, :, None].expand(R, nb, step_kv)
                sd = sb * sm_scale
                lse_d = torch.logsumexp(sd.view(R, -1), -1)
                lse_k = torch.logsumexp(sd.masked_fill(~keep_rows, -math.inf).view(R, -1), -1)
                om[b, h, r0:r1] = 1.0 - torch.exp(lse_k - lse_d)
    return {"retained_fraction": kept / max(legal, 1), "omitted_mass": om}


@torch.no_grad()
def blasst_critical(q, k, sm_scale=None, step_q=STEP_Q, step_kv=STEP_KV, chunk_rows=4096):
    """Per legal (head, 64-row group, 128-key step) block, the scale factor above which the kernel
    skips it: sf_crit = N * max_rows exp(sm_scale * (step_max - running_max)) (+inf for the first
    step).  retained(sf) = mean(sf_crit >= sf), so one pass gives the whole sparsity curve."""
    B, N, Hq, d = q.shape
    g = Hq // k.shape[2]
    sm_scale = sm_scale or 1.0 / math.sqrt(d)
    nb = (N + step_kv - 1) // step_kv
    rows_per = max(step_q, chunk_rows - chunk_rows % step_q)
    out = []
    for b in range(B):
        for h in range(Hq):
            kh = k[b, :, h // g].float()
            for r0 in range(0, N, rows_per):
                r1 = min(N, r0 + rows_per)
                R = r1 - r0
                if R % step_q:
                    raise ValueError("rows must be a multiple of step_q")
                s = q[b, r0:r1, h].float() @ kh.T
                rows = torch.arange(r0, r1, device=q.device)
                s = s.masked_fill(torch.arange(N, device=q.device)[None, :] > rows[:, None], -math.inf)
                s = torch.nn.functional.pad(s, (0, nb * step_kv - N), value=-math.inf)
                bmax = s.view(R, nb, step_kv).amax(-1)
                del s
                prev = torch.cat([torch.full_like(bmax[:, :1], -math.inf),
                                  torch.cummax(bmax, dim=1).values[:, :-1]], 1)
                ratio = torch.exp(sm_scale * (bmax - prev)).nan_to_num(nan=0.0)  # -inf - -inf: no entry
                ratio = torch.where(torch.isfinite(bmax), ratio, torch.zeros_like(ratio))
                crit = N * ratio.view(R // step_q, step_q, nb).amax(1)
                legal = torch.isfinite(bmax).view(R // step_q, step_q, nb).any(1)
                crit[:, 0] = math.inf
                out.append(crit[legal])
    return torch.cat(out)


def retained_at(crit, scale_factor):
    return 1.0 if scale_factor <= 0 else float((crit >= scale_factor).double().mean())


def matched_scale_factor(crit, retained):
    """The scale factor whose replayed retained fraction is closest to `retained` (3 digits)."""
    c = torch.sort(crit.float(), descending=True).values
    n = c.numel()
    kidx = min(max(int(round(retained * n)), 1), n)
    sf = float(c[kidx - 1]) if kidx < n else float(c[-1])
    if not math.isfinite(sf) or sf <= 0:
        return 0.0
    return float(f"{sf:.3g}")


# ---- the system -----------------------------------------------------------------------------------

def load_flashinfer():
    """flashinfer.prefill.trtllm_fmha_v2_prefill, or raise Unsupported with the reason."""
    if "fn" in _FI:
        return _FI["fn"]
    U = _unsupported()
    if "error" in _FI:
        raise U(_FI["error"])
    try:
        import flashinfer
        from flashinfer.prefill import trtllm_fmha_v2_prefill
        if os.environ.get("MALA_BENCH_FI_KERNELS", "d128") != "all":
            _restrict_jit_kernels()
        _FI["version"] = getattr(flashinfer, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        _FI["error"] = f"flashinfer not importable: {type(e).__name__}: {e}"
        raise U(_FI["error"])
    _FI["fn"] = trtllm_fmha_v2_prefill
    return _FI["fn"]


def _restrict_jit_kernels(head_sizes=(128,)):
    """The JIT build compiles every (head size x softcap x alibi x stats x skip) kernel of the
    layout, 11 warp-specialized head sizes; keep head size 128 without alibi and softcap (4 kernels:
    stats on/off x skip on/off).  MALA_BENCH_FI_KERNELS=all keeps the library's full list."""
    from flashinfer.jit.attention.fmha_v2 import fmha_library as lib
    if getattr(lib, "_mala_restricted", False):
        return
    orig = lib.is_kernel_spec_valid

    def valid(kspec):
        return (orig(kspec) and kspec.head_size in head_sizes and not kspec.alibi
                and not kspec.enable_attn_logit_softcapping)

    lib.is_kernel_spec_valid = valid
    lib._mala_restricted = True


def device_reason(major_minor):
    """None when skip-softmax kernels exist for this compute capability, else why not."""
    if tuple(major_minor)[0] == 9:
        return None
    return (f"fmha_v2 skip-softmax kernels are generated for sm_90 only (warp-specialized); "
            f"this device is sm_{major_minor[0]}{major_minor[1]}")


class FlashInferSkipSoftmax:
    """Built by systems.flashinfer_system (a subclass of systems.System, so the suite's loops
    treat it as any other); forward only."""

    forward_only = True

    def setup(self, scale_factor):
        self.scale_factor = float(scale_factor)
        self.tau = self.scale_factor          # the suite's omitted-mass flag: sf/(1+sf) bounds it
        self.sparse = self.scale_factor > 0
        self.name = "flashinfer" if not self.sparse else f"flashinfer_sf{self.scale_factor:g}"
        self.label = ("FlashInfer fmha_v2 (dense)" if not self.sparse
                      else f"FlashInfer skip-softmax sf={self.scale_factor:g}")
        self._ws = {}

    def available(self):
        try:
            load_flashinfer()
        except Exception as e:  # noqa: BLE001
            return str(e)
        if torch.cuda.is_available():
            why = device_reason(torch.cuda.get_device_capability())
            if why and self.sparse:
                return why
        return None

    def _call(self, qr, kv, B, N, stats=False):
        fn = load_flashinfer()
        dev = qr.device
        if dev not in self._ws:
            self._ws[dev] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            self._ws[(dev, "seq")] = cu_seqlens(B, N, dev)
        seq, cu = self._ws[(dev, "seq")]
        if seq.numel() != B or int(cu[-1]) != B * N:
            seq, cu = self._ws[(dev, "seq")] = cu_seqlens(B, N, dev)
        return fn((qr, kv), "CONTIGUOUS_Q_KV", self._ws[dev], seq, N, N, 1.0 / math.sqrt(qr.shape[-1]),
                  1.0, B, cu, cu, mask_mode="causal", save_softmax_stats=stats,
                  skip_softmax_threshold_scale_factor=self.scale_factor)

    def prepare(self, q, k, v, dout=None, need_grad=False):
        import systems
        B, N = q.shape[:2]
        qr, kv = to_ragged(q.detach(), k.detach(), v.detach())
        p = systems.Prepared(q=qr, kv=kv)

        def fwd():
            with torch.no_grad():
                return self._call(qr, kv, B, N)

        def no_bwd(*a, **kw):
            raise systems.Unsupported("FlashInfer fmha_v2 has no backward")

        p.fwd = fwd
        p.make_graph = p.bwd = p.bwd_once = p.fwd_bwd = no_bwd
        return p

    def forward(self, q, k, v):
        """O [B, N, Hq, d] of [B, N, H, d] inputs (GQA native), no stats: the model's prefill
        attention (lab/real/recipe.py).  The ragged copy of K and V is part of the call."""
        B, N = q.shape[:2]
        qr, kv = to_ragged(q, k, v)
        with torch.no_grad():
            o = self._call(qr, kv, B, N)
        return from_ragged(o[0] if isinstance(o, (tuple, list)) else o, B, N)

    def outputs(self, q, k, v):
        B, N, _, d = q.shape
        qr, kv = to_ragged(q, k, v)
        with torch.no_grad():
            o, st = self._call(qr, kv, B, N, stats=True)
        return from_ragged(o, B, N), lse_from_stats(st, B, N, 1.0 / math.sqrt(d), d)

    def rule_stats(self, q, k):
        """The replayed rule's retained fraction (the kernel reports none)."""
        r = blasst_rule(q, k, self.scale_factor)
        return {"fwd_retained_fraction": r["retained_fraction"], "retained_source": "rule replay",
                "fwd_tiles": [STEP_Q, STEP_KV]}

    def prepare_decode(self, q, k_cache, v_cache):
        import systems
        raise systems.Unsupported("no sm_90 skip-softmax decode in FlashInfer: the xqa backend "
                                  "(chosen off sm_100) does not take the scale factor")

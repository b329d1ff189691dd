"""Shared helpers: environment record, inputs, dense reference lse, omitted mass, result records."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time

import torch

import workloads
import rule_model


def env_info(systems_mod=None):
    info = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": os.environ.get("MALA_GIT_COMMIT") or _git_commit() or "unknown",
        "git_dirty": os.environ.get("MALA_GIT_DIRTY", "unknown"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "host": platform.node(),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["sm_count"] = p.multi_processor_count
        info["device_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["compute_capability"] = f"{p.major}.{p.minor}"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        parts = [x.strip() for x in line.split(",")]
        info["driver"] = parts[0] if parts else None
        info["sm_clock_max"] = parts[1] if len(parts) > 1 else None
        info["power_limit"] = parts[2] if len(parts) > 2 else None
    except Exception as e:  # noqa: BLE001
        info["driver"] = f"nvidia-smi failed: {e}"
    if systems_mod is not None:
        systems_mod.load_mala()
        systems_mod.load_fsa()
        info["mala"] = dict(systems_mod._MALA, mod=None) if systems_mod._MALA else None
        info["flash_sparse_attn"] = dict(systems_mod._FSA, mod=None) if systems_mod._FSA else None
        for d in (info["mala"], info["flash_sparse_attn"]):
            if d is not None:
                d.pop("mod", None)
    return info


def _git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def real_shape(prefix):
    """(N, Hq, Hkv, d) of captured states PREFIX_{q,k,v}.npy ([N, H, d] float16, lab/real/)."""
    import numpy as np
    q = np.load(prefix + "_q.npy", mmap_mode="r")
    k = np.load(prefix + "_k.npy", mmap_mode="r")
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2]


def load_real(prefix, B, N, seed, device, with_dout):
    """The first N rows of captured states as [B, N, H, d] (the same states in every batch entry),
    dO ~ N(0, 1) from the seed."""
    import numpy as np
    ts = []
    for name in ("q", "k", "v"):
        a = np.load(f"{prefix}_{name}.npy", mmap_mode="r")
        if a.shape[0] < N:
            raise ValueError(f"real input {prefix}: {a.shape[0]} rows captured, {N} asked")
        ts.append(torch.from_numpy(np.ascontiguousarray(a[:N])).to(device).unsqueeze(0).expand(B, -1, -1, -1).contiguous())
    dout = None
    if with_dout:
        g = torch.Generator(device=device).manual_seed(seed)
        dout = torch.randn(ts[0].shape, generator=g, device=device, dtype=torch.float32)
    return ts[0], ts[1], ts[2], dout


def make_inputs(regime, B, N, Hq, Hkv, d, sharpness=0.0, seed=0, device=None, dtype=torch.bfloat16,
                with_dout=True):
    """regime "random", "synthetic" (workloads.py), or "real:PREFIX" (captured states, load_real)."""
    import timing
    device = device or timing.DEVICE
    if regime.startswith("real:"):
        q, k, v, dout = load_real(regime[5:], B, N, seed, device, with_dout)
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return cast(q), cast(k), cast(v), cast(dout)
    q, k, v, dout = workloads.make_workload(regime, B, N, Hq, Hkv, d, sharpness, seed, device=device,
                                           with_dout=with_dout)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(dout)


@torch.no_grad()
def dense_lse(q, k, v, causal=True):
    """Dense lse [B, Hq, Nq] fp32 of bf16 inputs [B, N, H, d]: SDPA's flash kernel (K/V expanded to
    Hq heads), or an fp32 chunked computation when that is unavailable."""
    Hq, Hkv = q.shape[2], k.shape[2]
    try:
        qb = q.transpose(1, 2).contiguous()
        kb = k.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1).contiguous()
        vb = v.transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1).contiguous()
        res = torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, causal, False)
        lse = res[1].float()[..., :q.shape[1]]
        del qb, kb, vb, res
        return lse
    except Exception:  # noqa: BLE001
        if not causal or q.shape[1] != k.shape[1]:
            qf, kf = q.float(), k.float().repeat_interleave(Hq // Hkv, dim=2)
            s = torch.einsum("bmhd,bnhd->bhmn", qf, kf) / math.sqrt(q.shape[-1])
            return torch.logsumexp(s, dim=-1)
        return rule_model.dense_lse(q, k)


def omitted_mass(lse, lse_dense):
    """Per-row omitted dense mass 1 - exp(lse - lse_dense): (mean, max) over finite rows."""
    om = 1.0 - torch.exp(lse.float() - lse_dense.float())
    om = om[torch.isfinite(om)]
    if om.numel() == 0:
        return None, None
    return float(om.mean()), float(om.max())


def rel_l2(x, ref):
    x, ref = x.float(), ref.float()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


class Results:
    """All measurements; rewritten to disk after every record so a killed run keeps what it had."""

    def __init__(self, path, meta):
        self.path = path
        self.data = {"meta": meta, "records": [], "checks": [], "notes": []}
        self.flagged = {}  # system name -> reason (from the correctness guard)
        self.save()

    def add(self, rec):
        key = rec.get("system", "") + (":decode" if rec.get("op") == "decode" else "")
        if key in self.flagged and not rec.get("flagged"):
            rec["flagged"] = True
            rec["flag_reason"] = "correctness guard: " + self.flagged[key]
        self.data["records"].append(rec)
        self.save()

    def check(self, rec):
        self.data["checks"].append(rec)
        self.save()

    def note(self, text):
        self.data["notes"].append(text)
        self.save()

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=_json_default)
        os.replace(tmp, self.path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return str(o)


def fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB" if n is not None else "-"

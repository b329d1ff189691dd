"""The "random" and "synthetic" workloads of src/workload.cpp (mala::make_workload), in PyTorch.

This is a re-implementation of the formulas of src/workload.cpp (docs/workloads.md), element for
element: the same counter-based generator (splitmix64 over each element's counter, Box-Muller over
pairs of elements, evaluated in float64 and rounded to float32), the same streams, the same
RoPE-style rotation, sink and needles.  It runs on the GPU, so a 128K-token workload takes a fraction
of a second instead of a CPU pass.  `check_generator.py` beside this file compares it with the C++
generator bit for bit (it compiles src/workload.cpp with a small driver).

If the `mala` package exposes its own binding of make_workload, `mala_make_workload` below uses it;
the suite records which generator produced its inputs.

All int64 arithmetic below relies on two's-complement wrap-around of torch's int64 add/multiply
(what the CPU and CUDA kernels do); right shifts are made logical by masking.
"""

from __future__ import annotations

import math

import torch

# sha256 of the src/workload.cpp this port was compared with, element for element, by
# check_generator.py (which prints the current one).  The suite notes a mismatch in its results.
VALIDATED_CPP_SHA256 = "be058fa2b8a8c94cbe6c3080060bfc39ee4a6ee67adbd4d2b2dd359381d331ed"

MASK64 = (1 << 64) - 1
TWO_PI = 6.283185307179586476925286766559

STREAM_Q, STREAM_K, STREAM_V, STREAM_DOUT, STREAM_PHASE, STREAM_NEEDLE = 1, 2, 3, 4, 5, 6

# Synthetic-regime constants (must match src/workload.cpp).  The structured score peak is
# c(s) = PEAK * sqrt(s): a query scores its own position, its needle and the sink at about c(s).
PEAK = 12.0
SINK_QUERY_MAX = 4.0
ROPE_BASE = 10000.0
POSITIONS_PER_NEEDLE = 512

# Elements generated per chunk (bounds the float64/int64 temporaries to a few hundred MB).
CHUNK = 1 << 24


def _s64(x: int) -> int:
    """An unsigned 64-bit Python int as the signed int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def splitmix64_int(x: int) -> int:
    """splitmix64 on Python ints (exact, for scalars)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, stream: int) -> int:
    return splitmix64_int(splitmix64_int(seed & MASK64) ^ ((stream * 0xD1B54A32D192ED03) & MASK64))


_C0 = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _C0
    x = (x ^ _lsr(x, 30)) * _C1
    x = (x ^ _lsr(x, 27)) * _C2
    return x ^ _lsr(x, 31)


def uniform(key: int, counter: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) as float64: 53 random bits offset by half an ulp."""
    bits = _lsr(splitmix64(splitmix64(counter) ^ _s64(key)), 11)
    return (bits.to(torch.float64) + 0.5) * (1.0 / 9007199254740992.0)


def normals(key: int, first: int, count: int, device) -> torch.Tensor:
    """Standard normals (float64) for elements [first, first + count) of a stream."""
    idx = torch.arange(first, first + count, dtype=torch.int64, device=device)
    pair = idx >> 1
    u1 = uniform(key, 2 * pair)
    u2 = uniform(key, 2 * pair + 1)
    r = torch.sqrt(-2.0 * torch.log(u1))
    a = TWO_PI * u2
    return torch.where((idx & 1).bool(), r * torch.sin(a), r * torch.cos(a))


def fill_random(seed: int, stream: int, shape, device) -> torch.Tensor:
    """float32 tensor of `shape`, element i = normal(stream key, i)."""
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float32, device=device)
    key = stream_key(seed, stream)
    for first in range(0, n, CHUNK):
        count = min(CHUNK, n - first)
        out[first:first + count] = normals(key, first, count, device).to(torch.float32)
    return out.view(*shape)


class _Synthetic:
    """The structure of the synthetic regime (src/workload.cpp, struct Synthetic)."""

    def __init__(self, B, N, Hq, Hkv, d, sharpness, seed, device):
        self.B, self.N, self.Hq, self.Hkv, self.d = B, N, Hq, Hkv, d
        self.group = Hq // Hkv
        self.sink_dim = d - 1 if d >= 3 else -1
        self.pairs = (d - 1 if self.sink_dim >= 0 else d) // 2
        sqrt_d = math.sqrt(d)
        peak = PEAK * math.sqrt(sharpness)
        self.rope_amp = math.sqrt(peak * sqrt_d / self.pairs) if self.pairs > 0 else 0.0
        sink_q = SINK_QUERY_MAX * math.sqrt(sharpness / (1.0 + sharpness))
        sink_k = peak * sqrt_d / sink_q if sink_q > 0 else 0.0
        if self.sink_dim < 0:
            sink_q = sink_k = 0.0
        self.sink_q, self.sink_k = sink_q, sink_k
        # omega_f = pow(base, -f / pairs): computed with Python's pow (C's pow, correctly rounded
        # in practice), not torch.pow, so the frequencies are the C++ doubles.
        self.omega = torch.tensor([ROPE_BASE ** (-float(f) / float(self.pairs))
                                   for f in range(self.pairs)], dtype=torch.float64, device=device)
        pkey = stream_key(seed, STREAM_PHASE)
        cnt = torch.arange(B * Hkv * self.pairs, dtype=torch.int64, device=device)
        self.phase = (TWO_PI * uniform(pkey, cnt)).view(B, Hkv, self.pairs)
        # Needles: key u carries the rotation of a later position t. Few of them: drawn in float64
        # on the device, applied in order on the host (a later needle at the same u wins, as in C++).
        key_pos = torch.arange(N, dtype=torch.int64).repeat(B * Hkv, 1)
        needles = (N + POSITIONS_PER_NEEDLE - 1) // POSITIONS_PER_NEEDLE if N >= 3 else 0
        if needles:
            nkey = stream_key(seed, STREAM_NEEDLE)
            c = 2 * torch.arange(B * Hkv * needles, dtype=torch.int64, device=device)
            ua = uniform(nkey, c).cpu().tolist()
            ub = uniform(nkey, c + 1).cpu().tolist()
            for i in range(B * Hkv):
                for n in range(needles):
                    j = i * needles + n
                    u = 1 + int(ua[j] * float(N - 2))
                    t = u + 1 + int(ub[j] * float(N - 1 - u))
                    key_pos[i, u] = t
        self.key_pos = key_pos.view(B, Hkv, N).to(device)

    def rotation(self, pos: torch.Tensor, groups: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """float32 [rows, 2*pairs]: (amp*cos(a), amp*sin(a)) interleaved, a = omega*pos + phase."""
        ph = self.phase[batch, groups]                      # [rows, pairs]
        a = self.omega[None, :] * pos.to(torch.float64)[:, None] + ph
        rot = torch.stack((self.rope_amp * torch.cos(a), self.rope_amp * torch.sin(a)), dim=-1)
        return rot.reshape(pos.shape[0], 2 * self.pairs).to(torch.float32)


def _synthetic_q(sy: _Synthetic, seed: int, device) -> torch.Tensor:
    B, N, Hq, d = sy.B, sy.N, sy.Hq, sy.d
    key = stream_key(seed, STREAM_Q)
    rows = B * N * Hq
    out = torch.empty(rows, d, dtype=torch.float32, device=device)
    rows_per_chunk = max(1, CHUNK // d)
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        x = normals(key, r0 * d, (r1 - r0) * d, device).to(torch.float32).view(r1 - r0, d)
        r = torch.arange(r0, r1, dtype=torch.int64, device=device)
        h, t, b = r % Hq, (r // Hq) % N, r // (Hq * N)
        x[:, :2 * sy.pairs] += sy.rotation(t, h // sy.group, b)
        if sy.sink_dim >= 0:
            x[:, sy.sink_dim] += torch.tensor(sy.sink_q, dtype=torch.float64).to(torch.float32).item()
        out[r0:r1] = x
    return out.view(B, N, Hq, d)


def _synthetic_k(sy: _Synthetic, seed: int, device) -> torch.Tensor:
    B, N, Hkv, d = sy.B, sy.N, sy.Hkv, sy.d
    key = stream_key(seed, STREAM_K)
    rows = B * N * Hkv
    out = torch.empty(rows, d, dtype=torch.float32, device=device)
    rows_per_chunk = max(1, CHUNK // d)
    sink_k = torch.tensor(sy.sink_k, dtype=torch.float64).to(torch.float32).item()
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        x = normals(key, r0 * d, (r1 - r0) * d, device).to(torch.float32).view(r1 - r0, d)
        r = torch.arange(r0, r1, dtype=torch.int64, device=device)
        g, u, b = r % Hkv, (r // Hkv) % N, r // (Hkv * N)
        pos = sy.key_pos[b, g, u]
        x[:, :2 * sy.pairs] += sy.rotation(pos, g, b)
        if sy.sink_dim >= 0:
            x[:, sy.sink_dim] += torch.where(u == 0, sink_k, 0.0).to(torch.float32)
        out[r0:r1] = x
    return out.view(B, N, Hkv, d)


def make_workload(regime: str, batch: int, seqlen: int, heads_q: int, heads_kv: int,
                  head_dim: int, sharpness: float = 1.0, seed: int = 0, device="cuda",
                  with_dout: bool = True):
    """q, k, v, dout as float32 [B, N, H, d] (dout None unless with_dout), as mala::make_workload."""
    if regime not in ("random", "synthetic"):
        raise ValueError(f'regime: must be "random" or "synthetic" (got "{regime}")')
    if heads_q % heads_kv:
        raise ValueError("heads_kv must divide heads_q")
    if not (sharpness >= 0 and math.isfinite(sharpness)):
        raise ValueError("sharpness must be a finite number >= 0")
    B, N, Hq, Hkv, d = batch, seqlen, heads_q, heads_kv, head_dim
    if regime == "random" or sharpness == 0:
        q = fill_random(seed, STREAM_Q, (B, N, Hq, d), device)
        k = fill_random(seed, STREAM_K, (B, N, Hkv, d), device)
    else:
        sy = _Synthetic(B, N, Hq, Hkv, d, sharpness, seed, device)
        q = _synthetic_q(sy, seed, device)
        k = _synthetic_k(sy, seed, device)
    v = fill_random(seed, STREAM_V, (B, N, Hkv, d), device)
    dout = fill_random(seed, STREAM_DOUT, (B, N, Hq, d), device) if with_dout else None
    return q, k, v, dout


def mala_make_workload():
    """The mala package's own binding of make_workload, when it has one (else None)."""
    try:
        import mala  # noqa: F401
    except Exception:
        return None
    for name in ("make_workload", "workload"):
        fn = getattr(mala, name, None)
        if callable(fn):
            return fn
    return None


def cpp_source_status():
    """'validated' when src/workload.cpp is the version this port was checked against, else a
    warning (the port may be stale: run lab/suite/check_generator.py)."""
    import hashlib
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "workload.cpp")
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "src/workload.cpp not found next to the suite: port not re-checked"
    if digest == VALIDATED_CPP_SHA256:
        return "validated"
    return (f"WARNING: src/workload.cpp changed (sha256 {digest[:12]}) since lab/suite/workloads.py was "
            "checked against it; run lab/suite/check_generator.py")

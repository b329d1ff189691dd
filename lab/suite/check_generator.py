"""Compare lab/suite/workloads.py with the C++ generator (src/workload.cpp) element for element.

    python3 lab/suite/check_generator.py [--device cpu|cuda]

Compiles src/workload.cpp with a small driver (g++ -fopenmp), writes each tensor for a few specs,
and prints the largest absolute difference and the count of differing elements per tensor.  The
formulas are evaluated in float64 and rounded to float32 on both sides; the transcendental
functions (log, sqrt, cos, sin) of libm and of torch may differ in the last bit of a double, so a
rare element may differ by one float32 ulp.  Exit status 1 if any element differs by more.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "mala/mala.h"
int main(int argc, char** argv) {
  mala::WorkloadSpec s;
  s.regime = argv[1];
  s.batch = atoll(argv[2]); s.seqlen = atoll(argv[3]); s.heads_q = atoll(argv[4]);
  s.heads_kv = atoll(argv[5]); s.head_dim = atoll(argv[6]); s.sharpness = atof(argv[7]);
  s.seed = strtoull(argv[8], nullptr, 10);
  size_t nq = s.batch * s.seqlen * s.heads_q * s.head_dim, nk = s.batch * s.seqlen * s.heads_kv * s.head_dim;
  std::vector<float> q(nq), k(nk), v(nk), d(nq);
  mala::Status st = mala::make_workload(s, q.data(), k.data(), v.data(), d.data());
  if (!st) { fprintf(stderr, "%s\n", st.message.c_str()); return 1; }
  FILE* f = fopen(argv[9], "wb");
  fwrite(q.data(), 4, nq, f); fwrite(k.data(), 4, nk, f); fwrite(v.data(), 4, nk, f); fwrite(d.data(), 4, nq, f);
  fclose(f);
  return 0;
}
"""

SPECS = [
    # regime, B, N, Hq, Hkv, d, sharpness, seed
    ("random", 1, 1000, 8, 1, 128, 1.0, 0),
    ("synthetic", 1, 2048, 8, 1, 128, 2.0, 7),
    ("synthetic", 2, 1537, 4, 2, 64, 0.5, 123456789012345),
    ("synthetic", 1, 700, 2, 2, 5, 8.0, 3),
    ("synthetic", 1, 300, 1, 1, 2, 1.0, 1),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    drv = os.path.join(tmp, "drv.cpp")
    exe = os.path.join(tmp, "drv")
    with open(drv, "w") as f:
        f.write(DRIVER)
    subprocess.check_call(["g++", "-O2", "-std=c++17", "-fopenmp", "-I", os.path.join(ROOT, "include"),
                           drv, os.path.join(ROOT, "src", "workload.cpp"), "-o", exe])
    bad = False
    for spec in SPECS:
        regime, B, N, Hq, Hkv, d, sharp, seed = spec
        out = os.path.join(tmp, "w.bin")
        subprocess.check_call([exe, regime, str(B), str(N), str(Hq), str(Hkv), str(d), repr(sharp),
                               str(seed), out])
        ref = torch.from_numpy(__import__("numpy").fromfile(out, dtype="float32"))
        nq, nk = B * N * Hq * d, B * N * Hkv * d
        parts = torch.split(ref, [nq, nk, nk, nq])
        mine = workloads.make_workload(regime, B, N, Hq, Hkv, d, sharp, seed, device=args.device)
        for name, r, m in zip("q k v dout".split(), parts, mine):
            m = m.reshape(-1).cpu()
            diff = (m - r).abs()
            ulp = torch.finfo(torch.float32).eps * r.abs().clamp_min(1e-30)
            n_diff = int((diff > 0).sum())
            n_over = int((diff > 1.01 * ulp).sum())
            bad |= n_over > 0
            print(f"{spec} {name}: max|diff| {diff.max().item():.3g}, differing {n_diff}/{r.numel()}, "
                  f"beyond 1 ulp {n_over}")
    import hashlib
    with open(os.path.join(ROOT, "src", "workload.cpp"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    print("FAIL" if bad else "OK: matches the C++ generator (at most 1 ulp on rare elements)")
    print(f"src/workload.cpp sha256 {digest} (workloads.VALIDATED_CPP_SHA256 "
          f"{'matches' if digest == workloads.VALIDATED_CPP_SHA256 else 'differs: update it after an OK check'})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

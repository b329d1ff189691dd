// Uses the installed mala as a new user would: a CPU forward against naive causal attention, and a
// bad argument's Status.  Exits non-zero on any failure.
#include <cmath>
#include <cstdio>
#include <vector>

#include "mala/mala.h"

int main() {
  const int64_t N = 96, Hq = 2, Hkv = 1, d = 16;  // q, o: [1, N, Hq, d]; k, v: [1, N, Hkv, d]
  std::vector<float> q(N * Hq * d), k(N * Hkv * d), v(N * Hkv * d), o(q.size(), -1.f);
  unsigned s = 12345;
  auto rnd = [&s] { s = s * 1664525u + 1013904223u; return float(s >> 8) / float(1u << 24) - 0.5f; };
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = 2.f * rnd();

  mala::ForwardArgs a;  // CPU, float32, causal
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = o.data();
  a.seqlen_q = a.seqlen_k = N, a.heads_q = Hq, a.heads_kv = Hkv, a.head_dim = d;
  a.tau = 0.f;  // exact dense attention
  if (mala::Status st = mala::forward(a); !st) {
    std::fprintf(stderr, "consumer: forward failed: %s\n", st.message.c_str());
    return 1;
  }

  // Naive causal softmax attention, in double.
  double max_err = 0;
  const double scale = 1.0 / std::sqrt(double(d));
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / (Hq / Hkv);
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> p(i + 1);
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += double(q[(i * Hq + h) * d + c]) * k[(j * Hkv + hk) * d + c];
        p[j] = dot * scale;
        m = std::fmax(m, p[j]);
      }
      for (auto& x : p) sum += (x = std::exp(x - m));
      for (int64_t c = 0; c < d; ++c) {
        double ref = 0;
        for (int64_t j = 0; j <= i; ++j) ref += p[j] / sum * v[(j * Hkv + hk) * d + c];
        const double got = o[(i * Hq + h) * d + c];
        if (!std::isfinite(got)) {
          std::fprintf(stderr, "consumer: o is not finite at row %lld\n", (long long)i);
          return 1;
        }
        max_err = std::fmax(max_err, std::fabs(got - ref));
      }
    }
  }
  if (max_err > 1e-4) {
    std::fprintf(stderr, "consumer: forward differs from naive attention by %g\n", max_err);
    return 1;
  }

  // A bad argument: an error that names it, and nothing written.
  std::vector<float> before = o;
  mala::ForwardArgs bad = a;
  bad.tau = -1.f;
  mala::Status st = mala::forward(bad);
  if (st || st.message.find("tau") == std::string::npos || o != before) {
    std::fprintf(stderr, "consumer: tau = -1 gave ok=%d, message '%s'\n", int(st.ok), st.message.c_str());
    return 1;
  }
  std::printf("consumer: ok (max |o - naive| = %.2g; tau = -1 -> \"%s\")\n", max_err, st.message.c_str());
  return 0;
}

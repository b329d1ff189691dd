// mala::make_workload (src/workload.cpp, docs/workloads.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "mala/mala.h"

namespace {

struct Tensors {
  std::vector<float> q, k, v, dout;
};

Tensors generate(const mala::WorkloadSpec& s, bool with_dout = true) {
  Tensors t;
  t.q.assign(s.batch * s.seqlen * s.heads_q * s.head_dim, 0.f);
  t.dout.assign(t.q.size(), 0.f);
  t.k.assign(s.batch * s.seqlen * s.heads_kv * s.head_dim, 0.f);
  t.v.assign(t.k.size(), 0.f);
  mala::Status st =
      mala::make_workload(s, t.q.data(), t.k.data(), t.v.data(), with_dout ? t.dout.data() : nullptr);
  EXPECT_TRUE(st) << st.message;
  return t;
}

mala::WorkloadSpec spec(const char* regime, double sharpness, int64_t n = 256) {
  mala::WorkloadSpec s;
  s.regime = regime;
  s.sharpness = sharpness;
  s.seqlen = n;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 64;
  s.seed = 7;
  return s;
}

void expect_standard_normal(const std::vector<float>& x, const char* what) {
  double sum = 0, sq = 0, fourth = 0;
  for (float v : x) {
    sum += v;
    sq += double(v) * v;
    fourth += double(v) * v * v * v;
  }
  const double n = static_cast<double>(x.size());
  const double mean = sum / n, var = sq / n - mean * mean;
  // n >= 65536 here: the sampling error of the mean is <= 0.004, of the variance <= 0.006.
  EXPECT_NEAR(mean, 0.0, 0.02) << what;
  EXPECT_NEAR(var, 1.0, 0.03) << what;
  EXPECT_NEAR(fourth / n, 3.0, 0.15) << what;  // Gaussian kurtosis, not merely unit variance
}

TEST(Workload, DeterministicInSpecAndSeed) {
  for (const char* regime : {"random", "synthetic"}) {
    auto s = spec(regime, 4.0);
    Tensors a = generate(s), b = generate(s);
    EXPECT_EQ(a.q, b.q) << regime;
    EXPECT_EQ(a.k, b.k) << regime;
    EXPECT_EQ(a.v, b.v) << regime;
    EXPECT_EQ(a.dout, b.dout) << regime;
    s.seed = 8;
    Tensors c = generate(s);
    EXPECT_NE(a.q, c.q) << regime;
    EXPECT_NE(a.k, c.k) << regime;
    EXPECT_NE(a.v, c.v) << regime;
    EXPECT_NE(a.dout, c.dout) << regime;
  }
}

TEST(Workload, ElementsDoNotDependOnTheRestOfTheBatch) {
  // Counter-based generation: the first sequence of a batch of 3 is the batch-of-1 workload.
  for (const char* regime : {"random", "synthetic"}) {
    auto s = spec(regime, 5.0);
    Tensors one = generate(s);
    s.batch = 3;
    Tensors three = generate(s);
    EXPECT_TRUE(std::equal(one.q.begin(), one.q.end(), three.q.begin())) << regime;
    EXPECT_TRUE(std::equal(one.k.begin(), one.k.end(), three.k.begin())) << regime;
    EXPECT_TRUE(std::equal(one.v.begin(), one.v.end(), three.v.begin())) << regime;
    EXPECT_FALSE(std::equal(one.q.begin(), one.q.end(), three.q.begin() + one.q.size())) << regime;
  }
}

TEST(Workload, RandomRegimeIsStandardNormal) {
  auto s = spec("random", 0.0, 1024);
  Tensors t = generate(s);
  expect_standard_normal(t.q, "q");
  expect_standard_normal(t.k, "k");
  expect_standard_normal(t.v, "v");
  expect_standard_normal(t.dout, "dout");
  // Streams are independent: q and dout (same size) are uncorrelated.
  double cross = 0;
  for (size_t i = 0; i < t.q.size(); ++i) cross += double(t.q[i]) * t.dout[i];
  EXPECT_NEAR(cross / t.q.size(), 0.0, 0.02);
  // Neighbouring elements (the two halves of one Box-Muller draw) are uncorrelated too.
  double lag1 = 0;
  for (size_t i = 0; i + 1 < t.k.size(); i += 2) lag1 += double(t.k[i]) * t.k[i + 1];
  EXPECT_NEAR(lag1 / (t.k.size() / 2), 0.0, 0.03);
}

TEST(Workload, SharpnessZeroIsTheRandomRegime) {
  Tensors r = generate(spec("random", 3.0));
  Tensors s0 = generate(spec("synthetic", 0.0));
  EXPECT_EQ(r.q, s0.q);
  EXPECT_EQ(r.k, s0.k);
  EXPECT_EQ(r.v, s0.v);
  EXPECT_EQ(r.dout, s0.dout);
  // And sharpness > 0 adds structure to q and k only.
  Tensors s1 = generate(spec("synthetic", 1.0));
  EXPECT_NE(r.q, s1.q);
  EXPECT_NE(r.k, s1.k);
  EXPECT_EQ(r.v, s1.v);
  EXPECT_EQ(r.dout, s1.dout);
}

TEST(Workload, SyntheticNoiseIsTheRandomRegimesNoise) {
  // docs/workloads.md: every element is z (the random regime's value at the same index) plus
  // structure, and the dims outside the rotating pairs and the sink channel carry no structure.
  // Odd head_dim makes rows start at odd element indices (half a Box-Muller pair).
  for (int64_t d : {5, 64}) {
    auto r = spec("random", 0.0, 96), s = spec("synthetic", 7.0, 96);
    r.head_dim = s.head_dim = d;
    Tensors a = generate(r), b = generate(s);
    const int64_t pairs = (d - 1) / 2, sink = d - 1;
    int checked = 0;
    for (int64_t row = 0; row < 96 * s.heads_kv; ++row) {
      for (int64_t i = 2 * pairs; i < d; ++i) {
        const int64_t idx = row * d + i;
        if (i == sink && row < s.heads_kv) continue;  // key 0's sink channel is offset
        ASSERT_EQ(a.k[idx], b.k[idx]) << "d=" << d << " row " << row << " dim " << i;
        ++checked;
      }
      for (int64_t i = 0; i < 2 * pairs; ++i) ASSERT_NE(a.k[row * d + i], b.k[row * d + i]);
    }
    EXPECT_GT(checked, 90);
    for (int64_t row = 0; row < 96 * s.heads_q; ++row)
      for (int64_t i = 2 * pairs; i < sink; ++i) ASSERT_EQ(a.q[row * d + i], b.q[row * d + i]);
    EXPECT_EQ(a.v, b.v);
    EXPECT_EQ(a.dout, b.dout);
  }
}

TEST(Workload, NullDoutIsAllowed) {
  auto s = spec("synthetic", 2.0);
  Tensors with = generate(s, true), without = generate(s, false);
  EXPECT_EQ(with.q, without.q);
  EXPECT_EQ(with.k, without.k);
}

TEST(Workload, BadSpecNamesTheFieldAndWritesNothing) {
  struct Case {
    void (*edit)(mala::WorkloadSpec&);
    const char* field;
  };
  const Case cases[] = {
      {[](mala::WorkloadSpec& s) { s.regime = "real"; }, "regime:"},
      {[](mala::WorkloadSpec& s) { s.batch = 0; }, "batch:"},
      {[](mala::WorkloadSpec& s) { s.seqlen = 0; }, "seqlen:"},
      {[](mala::WorkloadSpec& s) { s.heads_q = 0; }, "heads_q:"},
      {[](mala::WorkloadSpec& s) { s.heads_kv = 0; }, "heads_kv:"},
      {[](mala::WorkloadSpec& s) { s.heads_kv = 3; }, "heads_kv:"},
      {[](mala::WorkloadSpec& s) { s.head_dim = 0; }, "head_dim:"},
      {[](mala::WorkloadSpec& s) { s.sharpness = -1; }, "sharpness:"},
      {[](mala::WorkloadSpec& s) { s.sharpness = NAN; }, "sharpness:"},
  };
  for (const Case& c : cases) {
    auto s = spec("synthetic", 1.0, 16);
    std::vector<float> q(16 * 4 * 64, 42.f), k(16 * 2 * 64, 42.f), v(k.size(), 42.f), d(q.size(), 42.f);
    c.edit(s);
    mala::Status st = mala::make_workload(s, q.data(), k.data(), v.data(), d.data());
    ASSERT_FALSE(st) << c.field;
    EXPECT_EQ(st.message.rfind(c.field, 0), 0u) << st.message;
    for (float x : q) ASSERT_EQ(x, 42.f) << c.field;
    for (float x : k) ASSERT_EQ(x, 42.f) << c.field;
  }
  auto s = spec("synthetic", 1.0, 16);
  std::vector<float> buf(16 * 4 * 64);
  mala::Status st = mala::make_workload(s, buf.data(), nullptr, buf.data(), nullptr);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.message.rfind("k:", 0), 0u) << st.message;
}

// Scores of one query row against keys [0, t] for head 0 (KV head 0), scale 1/sqrt(d).
std::vector<double> scores(const Tensors& t, const mala::WorkloadSpec& s, int64_t row) {
  std::vector<double> out(row + 1);
  const int64_t d = s.head_dim;
  for (int64_t u = 0; u <= row; ++u) {
    double acc = 0;
    for (int64_t i = 0; i < d; ++i)
      acc += double(t.q[(row * s.heads_q) * d + i]) * t.k[(u * s.heads_kv) * d + i];
    out[u] = acc / std::sqrt(double(d));
  }
  return out;
}

TEST(Workload, SyntheticHasLocalityAndASink) {
  auto s = spec("synthetic", 6.0, 1024);
  Tensors t = generate(s);
  int local_wins = 0, sink_top = 0, rows = 0;
  for (int64_t row = 512; row < 1024; row += 37, ++rows) {
    std::vector<double> sc = scores(t, s, row);
    // The recent keys outscore the middle of the context by a wide margin.
    double recent = *std::max_element(sc.end() - 8, sc.end());
    std::vector<double> middle(sc.begin() + 100, sc.begin() + 400);
    std::nth_element(middle.begin(), middle.begin() + middle.size() / 2, middle.end());
    if (recent - middle[middle.size() / 2] > 10) ++local_wins;
    // Key 0 (the sink) is within the top 1% of this row's scores.
    int above = 0;
    for (double x : sc) above += x > sc[0];
    if (above <= static_cast<int>(sc.size() / 100)) ++sink_top;
  }
  EXPECT_EQ(local_wins, rows);
  EXPECT_GE(sink_top, rows * 3 / 4);
  // At sharpness 0 neither holds.
  Tensors r = generate(spec("synthetic", 0.0, 1024));
  std::vector<double> sc = scores(r, s, 1000);
  double recent = *std::max_element(sc.end() - 8, sc.end());
  EXPECT_LT(recent - sc[500], 10);
}

// Retained fraction of legal tiles of MALA's forward at tau = 1.
double retained_at_tau1(double sharpness) {
  mala::WorkloadSpec s;
  s.regime = "synthetic";
  s.sharpness = sharpness;
  s.seqlen = 1024;
  s.heads_q = 2;
  s.heads_kv = 1;
  s.head_dim = 64;
  s.seed = 3;
  Tensors t = generate(s, false);
  const int block = 64;
  const int64_t tiles = s.seqlen / block;
  std::vector<float> o(t.q.size());
  std::vector<uint8_t> mask(s.heads_q * tiles * tiles);
  mala::ForwardArgs a;
  a.q = t.q.data();
  a.k = t.k.data();
  a.v = t.v.data();
  a.o = o.data();
  a.tile_mask = mask.data();
  a.seqlen_q = a.seqlen_k = s.seqlen;
  a.heads_q = s.heads_q;
  a.heads_kv = s.heads_kv;
  a.head_dim = s.head_dim;
  a.tau = 1.f;
  a.block_q = a.block_k = block;
  mala::Status st = mala::forward(a);
  EXPECT_TRUE(st) << st.message;
  return mala::retained_fraction(mask.data(), static_cast<int64_t>(mask.size()));
}

TEST(Workload, SharpnessReducesRetainedFractionMonotonically) {
  std::vector<double> fractions;
  for (double s : {0.0, 2.0, 4.0, 6.0, 8.0, 10.0}) {
    fractions.push_back(retained_at_tau1(s));
    std::printf("sharpness %4.1f: retained fraction %.4f\n", s, fractions.back());
  }
  // Random-like attention keeps (nearly) every tile.  The sharpest keeps little more than the
  // floor of three tiles per query tile (its diagonal, the one before it, the sink's tile 0):
  // (3 * 16 - 1) of the 136 legal 64x64 tiles at N = 1024.
  EXPECT_GE(fractions.front(), 0.95);
  EXPECT_LE(fractions.back(), (3.0 * 16 - 1) / 136 + 0.03);
  for (size_t i = 1; i < fractions.size(); ++i)
    EXPECT_LE(fractions[i], fractions[i - 1]) << "sharpness step " << i;
  EXPECT_LT(fractions[3], fractions[0] - 0.2);  // the middle of the range is already sparse
}

}  // namespace

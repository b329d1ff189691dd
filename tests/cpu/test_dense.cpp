// tau = 0 is exact dense attention: the tiled CPU forward/backward must match the double-precision
// dense reference, and the reference's gradients must match central finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "test_util.h"

using namespace mala_test;

namespace {

struct Shape {
  std::string name;
  int64_t batch, nq, nk, hq, hkv, d;
  bool causal;
  int bq, bk;
};

// Test names print the shape's name instead of its bytes.
void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }

void expect_dense(const Problem& p, double tol = 2e-5) {
  ForwardOut mine = run_forward(p), ref = run_forward(p, true);
  ASSERT_TRUE(mine.status.ok && ref.status.ok);
  EXPECT_LT(rel_l2(mine.o, ref.o), tol);
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_EQ(mine.lse[i], ref.lse[i]) << "row " << i;
    } else {
      EXPECT_NEAR(mine.lse[i], ref.lse[i], 1e-4 * (1 + std::fabs(ref.lse[i]))) << "row " << i;
    }
  }
  EXPECT_EQ(count_state(mine.mask, mala::kTileSkipped), 0);
  BackwardOut gmine = run_backward(p, mine), gref = run_backward(p, ref, true);
  EXPECT_LT(rel_l2(gmine.dq, gref.dq), tol);
  EXPECT_LT(rel_l2(gmine.dk, gref.dk), tol);
  EXPECT_LT(rel_l2(gmine.dv, gref.dv), tol);
  EXPECT_EQ(count_state(gmine.mask, mala::kTileSkipped), 0);
}

class DenseShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(DenseShapes, TauZeroEqualsDenseReference) {
  const Shape s = GetParam();
  Problem p;
  p.batch = s.batch;
  p.nq = s.nq;
  p.nk = s.nk;
  p.hq = s.hq;
  p.hkv = s.hkv;
  p.d = s.d;
  p.causal = s.causal;
  p.bq = s.bq;
  p.bk = s.bk;
  p.tau = 0.f;
  p.randomize(7);
  expect_dense(p);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, DenseShapes,
    ::testing::Values(Shape{"square", 1, 256, 256, 2, 2, 64, true, 64, 64},
                      Shape{"partial_tiles", 2, 200, 200, 2, 1, 32, true, 64, 48},
                      Shape{"q_shorter", 1, 70, 300, 4, 2, 32, true, 32, 64},
                      Shape{"q_longer_rows_without_keys", 1, 300, 70, 2, 2, 16, true, 64, 32},
                      Shape{"non_causal", 2, 130, 190, 2, 1, 32, false, 64, 64},
                      Shape{"default_tiles", 1, 300, 300, 1, 1, 64, true, 0, 0},
                      Shape{"odd_head_dim", 1, 97, 97, 3, 1, 19, true, 16, 24}),
    [](const ::testing::TestParamInfo<Shape>& info) { return info.param.name; });

TEST(Dense, VarlenTauZeroEqualsDenseReference) {
  Problem p;
  p.batch = 3;
  p.nq = 150;
  p.nk = 170;
  p.hq = 2;
  p.hkv = 1;
  p.d = 32;
  p.bq = 32;
  p.bk = 64;
  p.tau = 0.f;
  p.cu_q = {0, 150, 150, 250};  // the middle sequence is empty
  p.cu_k = {0, 170, 230, 330};
  p.randomize(11);
  expect_dense(p);
}

// Loss = sum(dout * O(q, k, v)); central differences in double on the dense forward.
TEST(Dense, ReferenceAndTauZeroGradientsMatchFiniteDifferences) {
  Problem p;
  p.batch = 1;
  p.nq = 9;
  p.nk = 12;
  p.hq = 2;
  p.hkv = 1;
  p.d = 8;
  p.bq = 4;
  p.bk = 4;
  p.tau = 0.f;
  p.randomize(3);
  ForwardOut fwd = run_forward(p, true);
  BackwardOut ref = run_backward(p, fwd, true);
  ForwardOut fwd_tiled = run_forward(p);
  BackwardOut tiled = run_backward(p, fwd_tiled);

  // Dense forward in double, independent of the library.
  auto loss = [&](const Problem& x) {
    double total = 0;
    const int64_t g = x.hq / x.hkv;
    const double scale = 1.0 / std::sqrt(static_cast<double>(x.d));
    for (int64_t h = 0; h < x.hq; ++h)
      for (int64_t r = 0; r < x.nq; ++r) {
        const int64_t L = std::min<int64_t>(x.nk, std::max<int64_t>(0, r + x.nk - x.nq + 1));
        std::vector<double> s(L);
        double mx = -INFINITY, sum = 0;
        for (int64_t k = 0; k < L; ++k) {
          double dot = 0;
          for (int64_t c = 0; c < x.d; ++c) dot += double(x.q[(r * x.hq + h) * x.d + c]) * x.k[(k * x.hkv + h / g) * x.d + c];
          s[k] = scale * dot;
          mx = std::max(mx, s[k]);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (int64_t c = 0; c < x.d; ++c) {
          double o = 0;
          for (int64_t k = 0; k < L; ++k) o += s[k] / sum * x.v[(k * x.hkv + h / g) * x.d + c];
          total += o * x.dout[(r * x.hq + h) * x.d + c];
        }
      }
    return total;
  };
  auto check = [&](std::vector<float> Problem::*field, const std::vector<float>& g_ref,
                   const std::vector<float>& g_tiled, const char* name) {
    const double eps = 1e-3;
    for (size_t i = 0; i < (p.*field).size(); i += 3) {
      Problem plus = p, minus = p;
      (plus.*field)[i] += static_cast<float>(eps);
      (minus.*field)[i] -= static_cast<float>(eps);
      const double h = double((plus.*field)[i]) - double((minus.*field)[i]);
      const double fd = (loss(plus) - loss(minus)) / h;
      EXPECT_NEAR(g_ref[i], fd, 2e-3 * (1 + std::fabs(fd))) << name << "[" << i << "] reference";
      EXPECT_NEAR(g_tiled[i], fd, 2e-3 * (1 + std::fabs(fd))) << name << "[" << i << "] tiled";
    }
  };
  check(&Problem::q, ref.dq, tiled.dq, "dq");
  check(&Problem::k, ref.dk, tiled.dk, "dk");
  check(&Problem::v, ref.dv, tiled.dv, "dv");
}

}  // namespace

// The MALA rule itself: the omitted-mass guarantee, first-tile retention, what tau does to the
// retained sets, backward-in-forward nesting, and the work accounting.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/rule.h"
#include "test_util.h"

using namespace mala_test;

namespace {

// Inputs with strong locality: q_i and k_j carry a rotary-like positional code whose dot product
// peaks at i = j and decays with distance, plus noise.
Problem local_problem(int64_t n, int64_t d, float sharpness, uint64_t seed) {
  Problem p;
  p.nq = p.nk = n;
  p.d = d;
  p.hq = 2;
  p.hkv = 1;
  p.randomize(seed, 0.5f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < d / 2; ++c) {
      const double w = std::pow(0.5, c * 8.0 / d);
      for (int64_t h = 0; h < p.hq; ++h) {
        p.q[(i * p.hq + h) * d + 2 * c] += sharpness * std::cos(w * i);
        p.q[(i * p.hq + h) * d + 2 * c + 1] += sharpness * std::sin(w * i);
      }
      p.k[i * d + 2 * c] += sharpness * std::cos(w * i);
      p.k[i * d + 2 * c + 1] += sharpness * std::sin(w * i);
    }
  return p;
}

// A key far from the diagonal (key 3, in tile 0, met last) that every query attends to strongly.
Problem far_needle_problem(int64_t n, int64_t d, uint64_t seed) {
  Problem p;
  p.nq = p.nk = n;
  p.d = d;
  p.randomize(seed, 2.f);
  for (int64_t i = 0; i < n; ++i) p.q[i * d] = 6.f;
  p.k[3 * d] = 6.f;
  return p;
}

// Scores grow with distance from the diagonal: each older tile looks negligible to nobody, and
// the near-diagonal tiles that seeded the normalizer become negligible only later.
Problem ramp_problem(int64_t n, int64_t d, uint64_t seed) {
  Problem p;
  p.nq = p.nk = n;
  p.d = d;
  p.randomize(seed, 0.3f);
  for (int64_t i = 0; i < n; ++i) p.q[i * d] = 4.f;
  for (int64_t j = 0; j < n; ++j) p.k[j * d] = 8.f * static_cast<float>(n - j) / static_cast<float>(n);
  return p;
}

struct Case {
  std::string name;
  Problem p;
};

std::vector<Case> rule_cases() {
  std::vector<Case> cases;
  Problem random;
  random.nq = random.nk = 512;
  random.d = 32;
  random.hq = 2;
  random.hkv = 2;
  random.randomize(21, 3.f);  // sharper than N(0,1) so that tiles get skipped
  cases.push_back({"random", random});
  cases.push_back({"local", local_problem(512, 32, 2.5f, 22)});
  cases.push_back({"far_needle", far_needle_problem(384, 32, 23)});
  cases.push_back({"ramp", ramp_problem(384, 32, 24)});
  for (auto& c : cases) c.p.bq = c.p.bk = 32;
  return cases;
}

class RuleCases : public ::testing::TestWithParam<float> {};

// eps_q = 1 - exp(lse - lse_dense) <= tau / (1 + tau) per row; every key whose dense probability
// exceeds tau / L_q sits in a retained tile.
TEST_P(RuleCases, OmittedMassBoundAndLargeKeysRetained) {
  const float tau = GetParam();
  int64_t total_skipped = 0;
  for (Case c : rule_cases()) {
    Problem& p = c.p;
    p.tau = tau;
    ForwardOut mala = run_forward(p), dense = run_forward(p, true);
    const double bound = tau / (1.0 + tau);
    const mala::Distribution eps = mala::omitted_mass(mala.lse.data(), dense.lse.data(), (int64_t)mala.lse.size());
    EXPECT_LE(eps.max, bound + 1e-5) << c.name << " tau=" << tau;
    EXPECT_EQ(eps.count, p.hq * p.nq) << c.name;
    total_skipped += count_state(mala.mask, mala::kTileSkipped);

    // Large keys: p_dense(q, k) > tau / L_q  =>  tile (q / bq, k / bk) retained.
    const int64_t g = p.hq / p.hkv;
    const double scale = 1.0 / std::sqrt(static_cast<double>(p.d));
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t r = 0; r < p.nq; r += 5) {
        const int64_t L = r + 1;
        const double lse_dense = dense.lse[h * p.nq + r];
        for (int64_t k = 0; k < L; ++k) {
          double dot = 0;
          for (int64_t x = 0; x < p.d; ++x) dot += double(p.q[(r * p.hq + h) * p.d + x]) * p.k[(k * p.hkv + h / g) * p.d + x];
          const double prob = std::exp(scale * dot - lse_dense);
          if (prob > 1.001 * tau / L) {
            const uint8_t state = mala.mask[(h * mala.n_q_tiles + r / p.bq) * mala.n_k_tiles + k / p.bk];
            ASSERT_EQ(state, mala::kTileRetained) << c.name << " h=" << h << " row=" << r << " key=" << k;
          }
        }
      }
  }
  EXPECT_GT(total_skipped, 0) << "the inputs must exercise skipping";
}

INSTANTIATE_TEST_SUITE_P(Cpu, RuleCases, ::testing::Values(0.1f, 1.f, 4.f));

// Each row's first tile in visiting order (the one holding its last visible key) is retained;
// legal tiles are never marked illegal and illegal tiles never visited.
TEST(Rule, FirstLegalTileRetainedAndLegalityExact) {
  for (Case c : rule_cases()) {
    Problem& p = c.p;
    p.tau = 4.f;
    p.nk = p.nq + 40;  // bottom-right offset: a row sees keys <= q + 40
    p.k.resize(p.nk * p.hkv * p.d, 0.5f);
    p.v.resize(p.nk * p.hkv * p.d, 0.5f);
    ForwardOut out = run_forward(p);
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t i = 0; i < out.n_q_tiles; ++i) {
        const int64_t last_row = std::min<int64_t>((i + 1) * p.bq, p.nq) - 1;
        const int64_t max_L = mala::rule::visible_keys((int)last_row, (int)p.nq, (int)p.nk, true);
        const uint8_t* m = &out.mask[(h * out.n_q_tiles + i) * out.n_k_tiles];
        for (int64_t j = 0; j < out.n_k_tiles; ++j) {
          const bool legal = j * p.bk < max_L;
          if (legal) {
            EXPECT_NE(m[j], mala::kTileIllegal) << c.name << " tile " << i << "," << j;
          } else {
            EXPECT_EQ(m[j], mala::kTileIllegal) << c.name << " tile " << i << "," << j;
          }
        }
        for (int64_t r = i * p.bq; r <= last_row; ++r) {
          const int64_t L = mala::rule::visible_keys((int)r, (int)p.nq, (int)p.nk, true);
          EXPECT_EQ(m[(L - 1) / p.bk], mala::kTileRetained) << c.name << " row " << r;
        }
      }
  }
}

// A hand-computed decision sequence (one query row, scale 1, Bk = 4, L = 10, non-causal):
// key tile 2 (keys 8, 9: score 0) is visited first, then tile 1 (four keys at ln 0.28), then
// tile 0 (one key at ln 0.31).  With Z = 2 after tile 2:
//   tau = 1   (threshold 0.1):  tile 1 ratio 0.14 retained; Z = 3.12; tile 0 ratio 0.0994 skipped.
//   tau = 1.5 (threshold 0.15): tile 1 ratio 0.14 skipped;  Z = 2;    tile 0 ratio 0.155 retained.
// So the forward's retained sets need not nest as tau grows (the normalizer depends on what was
// retained before); only the omitted-mass bound is monotone.
TEST(Rule, OnlineDecisionsByHandAndNonNesting) {
  Problem p;
  p.nq = 1;
  p.nk = 10;
  p.d = 4;
  p.causal = false;
  p.scale = 1.f;
  p.bq = 1;
  p.bk = 4;
  p.q = {1, 0, 0, 0};
  p.k.assign(40, 0.f);
  p.v.assign(40, 0.f);
  p.dout.assign(4, 0.f);
  for (int j = 0; j < 10; ++j) {
    p.k[j * 4] = j >= 8 ? 0.f : (j >= 4 ? std::log(0.28f) : (j == 0 ? std::log(0.31f) : -30.f));
    p.v[j * 4 + (j / 4)] = 1.f;  // value marks the tile
  }
  auto decisions = [&](float tau) {
    p.tau = tau;
    ForwardOut out = run_forward(p);
    return std::vector<uint8_t>(out.mask.begin(), out.mask.end());
  };
  using V = std::vector<uint8_t>;
  EXPECT_EQ(decisions(1.f), (V{mala::kTileSkipped, mala::kTileRetained, mala::kTileRetained}));
  EXPECT_EQ(decisions(1.5f), (V{mala::kTileRetained, mala::kTileSkipped, mala::kTileRetained}));
  EXPECT_EQ(decisions(0.5f), (V{mala::kTileRetained, mala::kTileRetained, mala::kTileRetained}));
  EXPECT_EQ(decisions(100.f), (V{mala::kTileSkipped, mala::kTileSkipped, mala::kTileRetained}));
  p.tau = 1.f;
  ForwardOut out = run_forward(p);
  // Retained keys 4..9: O = (0, 4*0.28, 2, 0) / 3.12, lse = log(3.12).
  EXPECT_NEAR(out.o[0], 0.f, 1e-6);
  EXPECT_NEAR(out.o[1], 1.12f / 3.12f, 1e-6);
  EXPECT_NEAR(out.o[2], 2.f / 3.12f, 1e-6);
  EXPECT_NEAR(out.lse[0], std::log(3.12f), 1e-6);
  EXPECT_EQ(out.slots[0], 8);
}

// On typical inputs the retained sets do shrink as tau grows (not a theorem, see above), and the
// backward's offline test against one fixed lse is monotone in tau by construction.
TEST(Rule, RetainedSetsShrinkAsTauGrows) {
  const float taus[] = {0.f, 0.5f, 1.f, 4.f, 16.f};
  int64_t dense_total = 0, sparse_total = 0;
  for (Case c : rule_cases()) {
    Problem& p = c.p;
    std::vector<uint8_t> prev_f, prev_b;
    p.tau = 0.f;
    const ForwardOut fixed = run_forward(p);  // one lse for every backward below
    int64_t prev_count = -1;
    for (float tau : taus) {
      p.tau = tau;
      ForwardOut f = run_forward(p);
      BackwardOut b = run_backward(p, fixed);
      if (!prev_f.empty()) {
        for (size_t x = 0; x < f.mask.size(); ++x) {
          if (f.mask[x] == mala::kTileRetained) EXPECT_EQ(prev_f[x], mala::kTileRetained) << c.name << " fwd tau=" << tau;
          if (b.mask[x] == mala::kTileRetained) ASSERT_EQ(prev_b[x], mala::kTileRetained) << c.name << " bwd tau=" << tau;
        }
      }
      const int64_t count = count_state(f.mask, mala::kTileRetained);
      if (prev_count >= 0) EXPECT_LE(count, prev_count) << c.name;
      prev_count = count;
      prev_f = f.mask;
      prev_b = b.mask;
    }
    dense_total += count_state(fixed.mask, mala::kTileRetained);
    sparse_total += prev_count;
  }
  EXPECT_LT(sparse_total, dense_total * 9 / 10) << "tau = 16 must skip some tiles";
}

// Backward support nested in forward support: same tiles, and 64x64 backward tiles inside 128x128
// forward tiles (also 32x64 inside 64x128).
TEST(Rule, BackwardRetainedWithinForwardRetained) {
  struct Nest {
    int fq, fk, bq, bk;
  };
  for (const Nest n : {Nest{32, 32, 32, 32}, Nest{128, 128, 64, 64}, Nest{64, 128, 32, 64}}) {
    for (Case c : rule_cases()) {
      Problem& p = c.p;
      for (float tau : {0.1f, 1.f, 4.f}) {
        p.tau = tau;
        p.bq = n.fq;
        p.bk = n.fk;
        ForwardOut f = run_forward(p);
        p.bq = n.bq;
        p.bk = n.bk;
        BackwardOut b = run_backward(p, f);
        const int64_t rq = n.fq / n.bq, rk = n.fk / n.bk;
        int64_t bwd_retained = 0, fwd_retained = 0;
        for (int64_t h = 0; h < p.hq; ++h)
          for (int64_t i = 0; i < b.n_q_tiles; ++i)
            for (int64_t j = 0; j < b.n_k_tiles; ++j) {
              const uint8_t bs = b.mask[(h * b.n_q_tiles + i) * b.n_k_tiles + j];
              const uint8_t fs = f.mask[(h * f.n_q_tiles + i / rq) * f.n_k_tiles + j / rk];
              if (bs == mala::kTileRetained) {
                ++bwd_retained;
                ASSERT_EQ(fs, mala::kTileRetained) << c.name << " tau=" << tau << " h=" << h << " tile " << i << "," << j;
              }
              if (bs != mala::kTileIllegal) EXPECT_NE(fs, mala::kTileIllegal);
            }
        fwd_retained = count_state(f.mask, mala::kTileRetained) * rq * rk;
        EXPECT_GT(bwd_retained, 0);
        EXPECT_LE(bwd_retained, fwd_retained);
      }
    }
  }
}

// fwd_slots / bwd_slots = block_k x retained tiles of the row's query tile; tau = 0 gives
// block_k x legal tiles; rows without visible keys get 0.
TEST(Rule, SlotAccountingMatchesTileMask) {
  for (Case c : rule_cases()) {
    Problem& p = c.p;
    p.nk = p.nq - 50;  // rows 0..49 see nothing
    p.k.resize(p.nk * p.hkv * p.d);
    p.v.resize(p.nk * p.hkv * p.d);
    for (float tau : {0.f, 1.f}) {
      p.tau = tau;
      ForwardOut f = run_forward(p);
      BackwardOut b = run_backward(p, f);
      for (int64_t h = 0; h < p.hq; ++h)
        for (int64_t r = 0; r < p.nq; ++r) {
          const int64_t i = r / p.bq;
          const uint8_t* fm = &f.mask[(h * f.n_q_tiles + i) * f.n_k_tiles];
          const uint8_t* bm = &b.mask[(h * b.n_q_tiles + i) * b.n_k_tiles];
          int64_t fr = 0, br = 0, legal = 0;
          for (int64_t j = 0; j < f.n_k_tiles; ++j) {
            fr += fm[j] == mala::kTileRetained;
            br += bm[j] == mala::kTileRetained;
            legal += fm[j] != mala::kTileIllegal;
          }
          const int64_t L = mala::rule::visible_keys((int)r, (int)p.nq, (int)p.nk, true);
          const int32_t fs = f.slots[h * p.nq + r], bs = b.slots[h * p.nq + r];
          if (L == 0) {
            EXPECT_EQ(fs, 0);
            EXPECT_EQ(bs, 0);
            EXPECT_EQ(f.lse[h * p.nq + r], -INFINITY);
            for (int64_t x = 0; x < p.d; ++x) EXPECT_EQ(f.o[(r * p.hq + h) * p.d + x], 0.f);
            continue;
          }
          ASSERT_EQ(fs, fr * p.bk) << c.name << " row " << r;
          ASSERT_EQ(bs, br * p.bk) << c.name << " row " << r;
          if (tau == 0.f) {
            ASSERT_EQ(fs, legal * p.bk);
            ASSERT_EQ(fs, mala::rule::ceil_div((int)std::min<int64_t>(p.nk, (i + 1) * p.bq - 50), p.bk) * p.bk);
          }
        }
      const mala::Distribution st = mala::slot_stats(f.slots.data(), 1, p.hq, p.nq, p.nk, true);
      EXPECT_EQ(st.count, p.hq * (p.nq - 50));
    }
  }
}

}  // namespace

namespace {

// At tau > 0 the forward is softmax renormalized over the keys of its retained tiles, and the
// backward is the attention gradient restricted to its retained tiles (P = exp(s - lse) with the
// saved lse).  Recomputed here in double from the tile masks alone, independently of the tiling.
TEST(Rule, ForwardAndBackwardEqualDenseMathOverRetainedTiles) {
  int64_t fwd_skipped = 0, bwd_skipped = 0;
  for (Case c : rule_cases()) {
    Problem& p = c.p;
    p.tau = 1.f;
    p.bq = 64;
    p.bk = 32;
    const ForwardOut f = run_forward(p);
    p.bq = 32;
    const BackwardOut b = run_backward(p, f);
    const int64_t g = p.hq / p.hkv, d = p.d;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    auto s_of = [&](int64_t h, int64_t r, int64_t k) {
      double dot = 0;
      for (int64_t x = 0; x < d; ++x) dot += double(p.q[(r * p.hq + h) * d + x]) * p.k[(k * p.hkv + h / g) * d + x];
      return scale * dot;
    };
    std::vector<float> o(p.q.size()), dq(p.q.size(), 0.f), dk(p.k.size(), 0.f), dv(p.v.size(), 0.f);
    std::vector<double> dkd(p.k.size(), 0.0), dvd(p.v.size(), 0.0);
    double max_lse_err = 0;
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t r = 0; r < p.nq; ++r) {
        const int64_t L = r + 1;
        // Forward over the retained forward tiles of row r's 64-row query tile.
        const uint8_t* fm = &f.mask[(h * f.n_q_tiles + r / 64) * f.n_k_tiles];
        double mx = -INFINITY;
        for (int64_t k = 0; k < L; ++k)
          if (fm[k / 32] == mala::kTileRetained) mx = std::max(mx, s_of(h, r, k));
        double sum = 0;
        std::vector<double> acc(d, 0.0);
        for (int64_t k = 0; k < L; ++k) {
          if (fm[k / 32] != mala::kTileRetained) continue;
          const double e = std::exp(s_of(h, r, k) - mx);
          sum += e;
          for (int64_t x = 0; x < d; ++x) acc[x] += e * p.v[(k * p.hkv + h / g) * d + x];
        }
        for (int64_t x = 0; x < d; ++x) o[(r * p.hq + h) * d + x] = static_cast<float>(acc[x] / sum);
        max_lse_err = std::max(max_lse_err, std::fabs(mx + std::log(sum) - f.lse[h * p.nq + r]));
        // Backward over the retained backward tiles of row r's 32-row query tile.
        const uint8_t* bm = &b.mask[(h * b.n_q_tiles + r / 32) * b.n_k_tiles];
        const double lse = f.lse[h * p.nq + r];
        double D = 0;
        for (int64_t x = 0; x < d; ++x) D += double(p.dout[(r * p.hq + h) * d + x]) * f.o[(r * p.hq + h) * d + x];
        std::vector<double> dqr(d, 0.0);
        for (int64_t k = 0; k < L; ++k) {
          if (bm[k / 32] != mala::kTileRetained) continue;
          const double P = std::exp(s_of(h, r, k) - lse);
          double dP = 0;
          for (int64_t x = 0; x < d; ++x) dP += double(p.dout[(r * p.hq + h) * d + x]) * p.v[(k * p.hkv + h / g) * d + x];
          const double dS = P * (dP - D);
          for (int64_t x = 0; x < d; ++x) {
            dqr[x] += scale * dS * p.k[(k * p.hkv + h / g) * d + x];
            dkd[(k * p.hkv + h / g) * d + x] += scale * dS * p.q[(r * p.hq + h) * d + x];
            dvd[(k * p.hkv + h / g) * d + x] += P * p.dout[(r * p.hq + h) * d + x];
          }
        }
        for (int64_t x = 0; x < d; ++x) dq[(r * p.hq + h) * d + x] = static_cast<float>(dqr[x]);
      }
    for (size_t x = 0; x < dk.size(); ++x) {
      dk[x] = static_cast<float>(dkd[x]);
      dv[x] = static_cast<float>(dvd[x]);
    }
    EXPECT_LT(rel_l2(f.o, o), 1e-5) << c.name;
    EXPECT_LT(max_lse_err, 1e-4) << c.name;
    EXPECT_LT(rel_l2(b.dq, dq), 1e-5) << c.name;
    EXPECT_LT(rel_l2(b.dk, dk), 1e-5) << c.name;
    EXPECT_LT(rel_l2(b.dv, dv), 1e-5) << c.name;
    fwd_skipped += count_state(f.mask, mala::kTileSkipped);
    bwd_skipped += count_state(b.mask, mala::kTileSkipped);
  }
  EXPECT_GT(fwd_skipped, 0);
  EXPECT_GT(bwd_skipped, fwd_skipped) << "the offline test skips more, and the tiles are smaller";
}

}  // namespace

// The backward kernel's form of the test (finite normalizer, threshold > -inf) decides exactly as
// rule::row_allows_skip under its preconditions, including rows without legal keys (tile_max = -inf,
// lse = -inf mapped to 0, threshold +inf).
TEST(Rule, FiniteNormFormEqualsTileTest) {
  const float inf = INFINITY;
  const float maxima[] = {-inf, -30.f, -1.5f, 0.f, 0.25f, 7.f, 1e30f};
  const float norms[] = {-20.f, -0.5f, 0.f, 3.f, 11.f};
  const float thresholds[] = {-17.f, -3.f, -0.25f, 0.f, 2.f, inf};
  for (float mx : maxima)
    for (float ln : norms)
      for (float th : thresholds)
        EXPECT_EQ(mala::rule::row_allows_skip_finite_norm(mx, ln, th), mala::rule::row_allows_skip(mx, ln, th))
            << "tile_max " << mx << " log_norm " << ln << " log_thr " << th;
  // A row without legal keys: lse = -inf is passed as 0 with threshold +inf, and never constrains.
  EXPECT_TRUE(mala::rule::row_allows_skip_finite_norm(-inf, 0.f, inf));
  EXPECT_TRUE(mala::rule::row_allows_skip(-inf, -inf, inf));
}

// The raw-score form (the warp-specialized forward compares the raw row max against a bound kept
// per row) decides as rule::row_allows_skip wherever the margin is not at the rounding level, and
// exactly for the special rows: nothing retained yet (log_norm = -inf), no legal key in the tile
// (raw = -inf), no legal key at all (log_thr = +inf, and then raw = -inf).
TEST(Rule, RawBoundFormEqualsTileTest) {
  const float inf = INFINITY;
  const float raws[] = {-inf, -300.f, -40.f, -1.5f, 0.f, 0.25f, 7.f, 55.f, 1e30f};
  const float norms[] = {-inf, -20.f, -0.5f, 0.f, 3.f, 11.f, 60.f};
  const float thresholds[] = {-17.f, -3.f, -0.25f, 0.f, 2.f, inf};
  const float scales[] = {0.125f * 1.4426950408889634f, 0.0883883476f * 1.4426950408889634f, 1.f, 3.f};
  int compared = 0;
  for (float sc : scales)
    for (float raw : raws)
      for (float ln : norms)
        for (float th : thresholds) {
          if (th == inf && raw != -inf) continue;  // L = 0: such a row has no legal score
          const float tile_max = raw * sc;
          const float margin = mala::rule::row_margin(tile_max, ln, th);
          if (std::isfinite(margin) && std::fabs(margin) < 1e-3f) continue;  // rounding flips allowed
          const float bound = mala::rule::skip_bound_raw(ln, th, 1.f / sc);
          EXPECT_EQ(mala::rule::row_allows_skip_raw(raw, bound), mala::rule::row_allows_skip(tile_max, ln, th))
              << "raw " << raw << " scale " << sc << " log_norm " << ln << " log_thr " << th;
          ++compared;
        }
  EXPECT_GT(compared, 1000);
  // Near the boundary the two forms differ by rounding only: a margin of 1e-3 is decided alike.
  const float sc = 0.0883883476f * 1.4426950408889634f, ln = 12.5f, th = -13.f;
  const float at = (ln + th) / sc;
  EXPECT_TRUE(mala::rule::row_allows_skip_raw(at - 1e-3f / sc, mala::rule::skip_bound_raw(ln, th, 1.f / sc)));
  EXPECT_FALSE(mala::rule::row_allows_skip_raw(at + 1e-3f / sc, mala::rule::skip_bound_raw(ln, th, 1.f / sc)));
}

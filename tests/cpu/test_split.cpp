// The call as one split of a longer causal sequence (ForwardArgs/BackwardArgs::rows_before,
// ForwardArgs::seed_lse, owns_tile0, owns_newest): what context parallelism runs per (query chunk,
// KV shard).  Checked against results computed another way:
//  - forward, seeded: the CPU decode with the seeded split-KV rule, whose splits own the same key
//    tiles as the shards, on the last query chunk (the decode computes its anchor masses itself);
//  - forward, tau = 0: dense attention, every chunk;
//  - backward: the whole-sequence backward given the same o and lse.  The offline test of a tile
//    depends only on its scores, the rows' lse and their whole lengths, so the decisions, the slots
//    and (up to summation order) the gradients must be the whole call's.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/rule.h"
#include "common/splits.h"
#include "cpu/common.h"
#include "test_util.h"

namespace {

using namespace mala_test;

constexpr int64_t kN = 512, kC = 128, kChunks = kN / kC, kHq = 2, kHkv = 1, kD = 32;
constexpr int kB = 32;  // block_q = block_k: 4 tiles per chunk

// q [N, Hq, d], k, v [N, Hkv, d] (batch 1) on the synthetic workload (sharp: tiles get skipped).
struct Seq {
  std::vector<float> q, k, v, dout;
};
Seq make_seq(double sharpness, uint64_t seed) {
  Seq s;
  mala::WorkloadSpec w;
  w.seqlen = kN, w.heads_q = kHq, w.heads_kv = kHkv, w.head_dim = kD, w.sharpness = sharpness, w.seed = seed;
  s.q.resize(kN * kHq * kD);
  s.k.resize(kN * kHkv * kD);
  s.v.resize(s.k.size());
  s.dout.resize(s.q.size());
  EXPECT_TRUE(mala::make_workload(w, s.q.data(), s.k.data(), s.v.data(), s.dout.data()).ok);
  return s;
}

template <class T>
std::vector<T> rows(const std::vector<T>& x, int64_t r0, int64_t n, int64_t width) {
  return std::vector<T>(x.begin() + r0 * width, x.begin() + (r0 + n) * width);
}

// Per (head, row) of query chunk a: log of the mass of the anchor tiles that key chunk b does not
// hold, as the decode computes it (each anchor tile's log-sum-exp, then rule::log_add_exp in tile
// order), so that the seeds are bit-identical to the decode's.
std::vector<float> seed_for(const Seq& s, int64_t a, int64_t b, float scale) {
  std::vector<float> seed(kHq * kC, -INFINITY);
  for (int64_t h = 0; h < kHq; ++h)
    for (int64_t r = 0; r < kC; ++r) {
      const int64_t row = a * kC + r, L = row + 1;
      const int64_t newest = (L - 1) / kB;
      std::vector<int64_t> anchors;
      if (b != 0) anchors.push_back(0);
      if (b != a && newest != 0) anchors.push_back(newest);
      float acc = -INFINITY;
      for (int64_t j : anchors) {
        const int64_t kb = j * kB, n = std::min<int64_t>(L - kb, kB);
        float mx = -INFINITY;
        std::vector<float> sc(n);
        for (int64_t c = 0; c < n; ++c)
          mx = std::max(mx, sc[c] = mala::cpu::detail::score(&s.q[(row * kHq + h) * kD], &s.k[((kb + c) * kHkv + h / (kHq / kHkv)) * kD], kD, scale));
        float sum = 0.f;
        for (int64_t c = 0; c < n; ++c) sum += std::exp(sc[c] - mx);
        acc = mala::rule::log_add_exp(acc, mx + std::log(sum));
      }
      seed[h * kC + r] = acc;
    }
  return seed;
}

struct Merged {
  std::vector<float> o, lse;
  std::vector<int32_t> slots;
};

// Query chunk a against key chunks 0..a as seeded splits, merged by lse.
Merged chunk_forward(const Seq& s, int64_t a, float tau, bool seeded) {
  const float scale = 1.f / std::sqrt(static_cast<float>(kD));
  const std::vector<float> q = rows(s.q, a * kC, kC, kHq * kD);
  std::vector<std::vector<float>> os, lses;
  Merged m;
  m.slots.assign(kHq * kC, 0);
  for (int64_t b = 0; b <= a; ++b) {
    const std::vector<float> k = rows(s.k, b * kC, kC, kHkv * kD), v = rows(s.v, b * kC, kC, kHkv * kD);
    const std::vector<float> seed = seed_for(s, a, b, scale);
    std::vector<float> o(q.size(), NAN), lse(kHq * kC, NAN);
    std::vector<int32_t> slots(kHq * kC, -1);
    mala::ForwardArgs f;
    f.q = q.data(), f.k = k.data(), f.v = v.data(), f.o = o.data(), f.lse = lse.data(), f.fwd_slots = slots.data();
    f.seqlen_q = f.seqlen_k = kC, f.heads_q = kHq, f.heads_kv = kHkv, f.head_dim = kD;
    f.causal = b == a;
    f.tau = tau;
    f.block_q = f.block_k = kB;
    f.rows_before = a * kC;
    if (seeded && a > 0) {
      f.seed_lse = seed.data();
      f.owns_tile0 = b == 0;
      f.owns_newest = b == a;
    }
    const mala::Status st = mala::forward(f);
    EXPECT_TRUE(st.ok) << st.message;
    for (size_t x = 0; x < slots.size(); ++x) m.slots[x] += slots[x];
    os.push_back(o);
    lses.push_back(lse);
  }
  m.o.assign(q.size(), 0.f);
  m.lse.assign(kHq * kC, -INFINITY);
  for (int64_t h = 0; h < kHq; ++h)
    for (int64_t r = 0; r < kC; ++r) {
      float mx = -INFINITY;
      for (auto& l : lses) mx = std::max(mx, l[h * kC + r]);
      double sum = 0;
      for (auto& l : lses) sum += std::exp(double(l[h * kC + r]) - mx);
      const float lse = mx + float(std::log(sum));
      m.lse[h * kC + r] = lse;
      for (size_t s2 = 0; s2 < os.size(); ++s2) {
        const float w = std::exp(lses[s2][h * kC + r] - lse);
        if (w == 0.f) continue;
        for (int64_t x = 0; x < kD; ++x) m.o[(r * kHq + h) * kD + x] += w * os[s2][(r * kHq + h) * kD + x];
      }
    }
  return m;
}

TEST(Split, SeededShardsEqualSeededDecodeOnTheLastChunk) {
  for (double sharpness : {0.0, 8.0}) {
    const Seq s = make_seq(sharpness, 7);
    const int64_t a = kChunks - 1;
    const Merged m = chunk_forward(s, a, 1.f, true);

    mala::DecodeArgs d;
    const std::vector<float> q = rows(s.q, a * kC, kC, kHq * kD);
    std::vector<float> kc = s.k, vc = s.v, o(q.size(), NAN), lse(kHq * kC, NAN);
    std::vector<int32_t> slots(kHq * kC, -1), lens = {static_cast<int32_t>(kN)};
    d.q = q.data(), d.k_cache = kc.data(), d.v_cache = vc.data(), d.cache_seqlens = lens.data();
    d.o = o.data(), d.lse = lse.data(), d.fwd_slots = slots.data();
    d.seqlen_q = kC, d.cache_capacity = kN, d.heads_q = kHq, d.heads_kv = kHkv, d.head_dim = kD;
    d.block_q = d.block_k = kB;
    d.num_splits = static_cast<int>(kChunks);  // split s owns key tiles [4s, 4s + 4): chunk s
    d.split_rule = mala::SplitRule::seeded;
    d.pack_gqa = false;
    const mala::Status st = mala::decode(d);
    ASSERT_TRUE(st.ok) << st.message;

    EXPECT_EQ(m.slots, slots) << "sharpness " << sharpness;
    EXPECT_LT(rel_l2(m.o, o), 1e-5);
    for (size_t x = 0; x < lse.size(); ++x) ASSERT_NEAR(m.lse[x], lse[x], 1e-4);
    if (sharpness > 0) {  // the test can fail: tiles are skipped
      int64_t total = 0;
      for (int32_t x : slots) total += x;
      int64_t dense = 0;
      for (int64_t r = 0; r < kC; ++r) dense += kHq * ((a * kC + r) / kB + 1) * kB;
      EXPECT_LT(total, dense * 3 / 4) << "the sharp input should skip tiles: " << total << " of " << dense;
    }
  }
}

TEST(Split, TauZeroShardsEqualDenseAttention) {
  const Seq s = make_seq(3.0, 11);
  mala::ForwardArgs f;
  std::vector<float> o(s.q.size()), lse(kHq * kN);
  f.q = s.q.data(), f.k = s.k.data(), f.v = s.v.data(), f.o = o.data(), f.lse = lse.data();
  f.seqlen_q = f.seqlen_k = kN, f.heads_q = kHq, f.heads_kv = kHkv, f.head_dim = kD;
  ASSERT_TRUE(mala::reference::dense_forward(f).ok);
  for (int64_t a = 0; a < kChunks; ++a) {
    const Merged m = chunk_forward(s, a, 0.f, true);
    EXPECT_LT(rel_l2(m.o, rows(o, a * kC, kC, kHq * kD)), 1e-5) << "chunk " << a;
    for (int64_t h = 0; h < kHq; ++h)
      for (int64_t r = 0; r < kC; ++r) ASSERT_NEAR(m.lse[h * kC + r], lse[h * kN + a * kC + r], 1e-4);
  }
}

// The bound of the seeded rule over every row of every chunk: omitted mass <= tau / (1 + tau).
TEST(Split, OmittedMassWithinBound) {
  for (uint64_t seed : {1, 2, 3}) {
    const Seq s = make_seq(1.0 + seed, seed);
    mala::ForwardArgs f;
    std::vector<float> o(s.q.size()), lse(kHq * kN);
    f.q = s.q.data(), f.k = s.k.data(), f.v = s.v.data(), f.o = o.data(), f.lse = lse.data();
    f.seqlen_q = f.seqlen_k = kN, f.heads_q = kHq, f.heads_kv = kHkv, f.head_dim = kD;
    ASSERT_TRUE(mala::reference::dense_forward(f).ok);
    for (float tau : {0.5f, 1.f, 4.f})
      for (int64_t a = 0; a < kChunks; ++a) {
        const Merged m = chunk_forward(s, a, tau, true);
        for (int64_t h = 0; h < kHq; ++h)
          for (int64_t r = 0; r < kC; ++r) {
            const double omitted = 1.0 - std::exp(double(m.lse[h * kC + r]) - lse[h * kN + a * kC + r]);
            ASSERT_LE(omitted, tau / (1.0 + tau) + 1e-5) << "tau " << tau << " chunk " << a << " row " << r;
          }
      }
  }
}

TEST(Split, ShardedBackwardEqualsWholeBackward) {
  const Seq s = make_seq(3.0, 5);
  Problem p;
  p.nq = p.nk = kN, p.hq = kHq, p.hkv = kHkv, p.d = kD, p.bq = p.bk = kB, p.tau = 1.f;
  p.q = s.q, p.k = s.k, p.v = s.v, p.dout = s.dout;
  const ForwardOut fwd = run_forward(p);
  const BackwardOut whole = run_backward(p, fwd);
  ASSERT_LT(count_state(whole.mask, mala::kTileRetained), count_state(whole.mask, mala::kTileSkipped) * 4)
      << "the sharp input should skip backward tiles";

  std::vector<float> dq(s.q.size(), 0.f), dk(s.k.size(), 0.f), dv(s.v.size(), 0.f);
  std::vector<int32_t> slots(kHq * kN, 0);
  for (int64_t a = 0; a < kChunks; ++a)
    for (int64_t b = 0; b <= a; ++b) {
      const std::vector<float> q = rows(s.q, a * kC, kC, kHq * kD), o = rows(fwd.o, a * kC, kC, kHq * kD),
                               dout = rows(s.dout, a * kC, kC, kHq * kD);
      const std::vector<float> k = rows(s.k, b * kC, kC, kHkv * kD), v = rows(s.v, b * kC, kC, kHkv * kD);
      std::vector<float> lse(kHq * kC);
      for (int64_t h = 0; h < kHq; ++h)
        std::copy_n(&fwd.lse[h * kN + a * kC], kC, &lse[h * kC]);
      std::vector<float> dq_ab(q.size()), dk_ab(k.size()), dv_ab(v.size());
      std::vector<int32_t> sl(kHq * kC);
      mala::BackwardArgs g;
      g.q = q.data(), g.k = k.data(), g.v = v.data(), g.o = o.data(), g.dout = dout.data(), g.lse = lse.data();
      g.dq = dq_ab.data(), g.dk = dk_ab.data(), g.dv = dv_ab.data(), g.bwd_slots = sl.data();
      g.seqlen_q = g.seqlen_k = kC, g.heads_q = kHq, g.heads_kv = kHkv, g.head_dim = kD;
      g.causal = a == b, g.tau = 1.f, g.block_q = g.block_k = kB, g.rows_before = a * kC;
      const mala::Status st = mala::backward(g);
      ASSERT_TRUE(st.ok) << st.message;
      for (size_t x = 0; x < q.size(); ++x) dq[a * kC * kHq * kD + x] += dq_ab[x];
      for (size_t x = 0; x < k.size(); ++x) dk[b * kC * kHkv * kD + x] += dk_ab[x], dv[b * kC * kHkv * kD + x] += dv_ab[x];
      for (int64_t h = 0; h < kHq; ++h)
        for (int64_t r = 0; r < kC; ++r) slots[h * kN + a * kC + r] += sl[h * kC + r];
    }
  EXPECT_EQ(slots, whole.slots);
  EXPECT_LT(rel_l2(dq, whole.dq), 1e-5);
  EXPECT_LT(rel_l2(dk, whole.dk), 1e-5);
  EXPECT_LT(rel_l2(dv, whole.dv), 1e-5);
}

TEST(Split, BadArgumentsAreNamed) {
  Problem p;
  p.nq = 64, p.nk = 64, p.hq = 2, p.hkv = 1, p.d = 16;
  p.randomize(3);
  std::vector<float> o(p.q.size()), seed(2 * 64, 0.f);
  mala::ForwardArgs f = p.forward_args();
  f.o = o.data();
  f.rows_before = -2;
  EXPECT_NE(mala::forward(f).message.find("rows_before: must be -1"), std::string::npos);
  f.rows_before = 0;
  f.causal = false;  // a non-causal split sees all 64 keys: its rows are at least 64 long
  EXPECT_NE(mala::forward(f).message.find("rows_before: must be >= seqlen_k - 1"), std::string::npos);
  f.rows_before = 63;
  EXPECT_TRUE(mala::forward(f).ok);
  f.owns_tile0 = true;
  EXPECT_NE(mala::forward(f).message.find("owns_tile0: only applies with seed_lse"), std::string::npos);
  f.seed_lse = seed.data();
  EXPECT_TRUE(mala::forward(f).ok);
  f.lse = seed.data();  // an output on the seed
  EXPECT_NE(mala::forward(f).message.find("lse: overlaps seed_lse"), std::string::npos);

  mala::BackwardArgs g = p.backward_args();
  std::vector<float> lse(2 * 64, 0.f), dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
  g.o = o.data(), g.lse = lse.data(), g.dq = dq.data(), g.dk = dk.data(), g.dv = dv.data();
  g.rows_before = 5;  // causal, square: any rows_before >= 0
  EXPECT_TRUE(mala::backward(g).ok);
  std::vector<int32_t> cu = {0, 64};
  g.cu_seqlens_q = g.cu_seqlens_k = cu.data();
  EXPECT_NE(mala::backward(g).message.find("rows_before: is not supported with varlen"), std::string::npos);
}

// The decode's automatic split count (num_splits = 0, src/cuda/decode/dispatch.cu): one wave of
// CTAs, within the cache's key tiles and within the bound a caller may ask for.  It picked 132 on a
// 132-SM H100 / H200 for one CTA per split, past kMaxNumSplits = 128, which the API refuses.
TEST(Split, AutomaticCountStaysWithinTheCallersBound) {
  EXPECT_EQ(mala::splits::auto_num_splits(1, 1000, 132), mala::kMaxNumSplits);
  EXPECT_EQ(mala::splits::auto_num_splits(2, 1000, 132), 66);
  EXPECT_EQ(mala::splits::auto_num_splits(1, 5, 132), 5);
  EXPECT_EQ(mala::splits::auto_num_splits(200, 1000, 132), 1);
  EXPECT_EQ(mala::splits::auto_num_splits(1, 0, 132), 1);
  for (int sms : {1, 78, 108, 132, 144, 264, 1024})
    for (int64_t ctas : {0, 1, 2, 3, 7, 64, 1000})
      for (int64_t tiles : {0, 1, 9, 200, 4096}) {
        const int n = mala::splits::auto_num_splits(ctas, tiles, sms);
        EXPECT_GE(n, 1);
        EXPECT_LE(n, mala::kMaxNumSplits) << sms << " " << ctas << " " << tiles;
        if (tiles >= 1) EXPECT_LE(n, tiles);
      }
}

}  // namespace

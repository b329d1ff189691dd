// Decode against a KV cache: one split reproduces the forward rule exactly, more splits retain at
// least as much, paged caches behave like contiguous ones, k_new/v_new are appended, and batches
// of different cache lengths equal their sequences run alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>

#include "test_util.h"

using namespace mala_test;

namespace {

// Contiguous fp32 cache [batch, capacity, hkv, d], q [batch, sq, hq, d], optional new keys.
struct DecodeProblem {
  int64_t batch = 1, sq = 1, seqlen_new = 0, hq = 1, hkv = 1, d = 32, capacity = 0;
  std::vector<int32_t> cache_seqlens;
  std::vector<float> q, k_cache, v_cache, k_new, v_new;
  bool causal = true, pack_gqa = false;
  float tau = 1.f;
  int bq = 0, bk = 0, num_splits = 1;
  mala::SplitRule split_rule = mala::SplitRule::per_split;
  int64_t page_size = 0;  // > 0: run paged with a shuffled block table

  void randomize(uint64_t seed, float q_std = 2.f) {
    q = randn(batch * sq * hq * d, seed * 5 + 1, q_std);
    k_cache = randn(batch * capacity * hkv * d, seed * 5 + 2);
    v_cache = randn(batch * capacity * hkv * d, seed * 5 + 3);
    if (seqlen_new > 0) {
      k_new = randn(batch * seqlen_new * hkv * d, seed * 5 + 4);
      v_new = randn(batch * seqlen_new * hkv * d, seed * 5 + 5);
    }
  }
};

struct DecodeOut {
  mala::Status status;
  std::vector<float> o, lse, k_after, v_after;  // caches after the call, in contiguous layout
  std::vector<int32_t> slots;
  std::vector<uint8_t> mask;
  int64_t n_q_tiles = 0, n_k_tiles = 0;
};

DecodeOut run_decode(const DecodeProblem& p) {
  DecodeOut out;
  mala::DecodeArgs a;
  a.q = p.q.data();
  a.batch = p.batch;
  a.seqlen_q = p.sq;
  a.seqlen_new = p.seqlen_new;
  a.heads_q = p.hq;
  a.heads_kv = p.hkv;
  a.head_dim = p.d;
  a.causal = p.causal;
  a.tau = p.tau;
  a.block_q = p.bq;
  a.block_k = p.bk;
  a.num_splits = p.num_splits;
  a.split_rule = p.split_rule;
  a.pack_gqa = p.pack_gqa;
  a.cache_seqlens = p.cache_seqlens.data();
  if (p.seqlen_new > 0) {
    a.k_new = p.k_new.data();
    a.v_new = p.v_new.data();
  }
  const int64_t row = p.hkv * p.d;  // elements per cache position
  std::vector<float> kc = p.k_cache, vc = p.v_cache;
  std::vector<int32_t> table;
  int64_t pages_per_seq = 0, num_pages = 0;
  if (p.page_size > 0) {
    // Pages of page_size positions; sequence b's page t lives at a shuffled physical page.
    pages_per_seq = p.capacity / p.page_size;
    num_pages = p.batch * pages_per_seq + 3;  // a few unused pages
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::reverse(perm.begin(), perm.end());
    std::rotate(perm.begin(), perm.begin() + 2, perm.end());
    table.assign(perm.begin(), perm.begin() + p.batch * pages_per_seq);
    kc.assign(num_pages * p.page_size * row, -99.f);
    vc.assign(num_pages * p.page_size * row, -99.f);
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t pos = 0; pos < p.capacity; ++pos) {
        const int64_t page = table[b * pages_per_seq + pos / p.page_size];
        std::copy_n(&p.k_cache[(b * p.capacity + pos) * row], row, &kc[(page * p.page_size + pos % p.page_size) * row]);
        std::copy_n(&p.v_cache[(b * p.capacity + pos) * row], row, &vc[(page * p.page_size + pos % p.page_size) * row]);
      }
    a.block_table = table.data();
    a.max_pages = pages_per_seq;
    a.page_size = p.page_size;
    a.num_pages = num_pages;
  } else {
    a.cache_capacity = p.capacity;
  }
  a.k_cache = kc.data();
  a.v_cache = vc.data();
  const mala::Tiles t = mala::decode_tiles(a);
  const int64_t group = p.hq / p.hkv;
  out.n_q_tiles = ceil_div(p.pack_gqa ? p.sq * group : p.sq, t.block_q);
  out.n_k_tiles = ceil_div(p.capacity, t.block_k);
  out.o.assign(p.batch * p.sq * p.hq * p.d, NAN);
  out.lse.assign(p.batch * p.hq * p.sq, NAN);
  out.slots.assign(out.lse.size(), -1);
  out.mask.assign(p.batch * (p.pack_gqa ? p.hkv : p.hq) * out.n_q_tiles * out.n_k_tiles, 0xff);
  a.o = out.o.data();
  a.lse = out.lse.data();
  a.fwd_slots = out.slots.data();
  a.tile_mask = out.mask.data();
  out.status = mala::decode(a);
  EXPECT_TRUE(out.status.ok) << out.status.message;
  // Back to the contiguous layout.
  if (p.page_size > 0) {
    out.k_after.resize(p.k_cache.size());
    out.v_after.resize(p.v_cache.size());
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t pos = 0; pos < p.capacity; ++pos) {
        const int64_t page = table[b * pages_per_seq + pos / p.page_size];
        std::copy_n(&kc[(page * p.page_size + pos % p.page_size) * row], row, &out.k_after[(b * p.capacity + pos) * row]);
        std::copy_n(&vc[(page * p.page_size + pos % p.page_size) * row], row, &out.v_after[(b * p.capacity + pos) * row]);
      }
  } else {
    out.k_after = kc;
    out.v_after = vc;
  }
  return out;
}

// The forward problem whose last query tile is exactly the decode's rows: N keys = the cache
// (plus the new keys), the decode tokens are the last sq query rows.
Problem forward_twin(const DecodeProblem& dp, const DecodeOut& after) {
  Problem p;
  const int64_t n = dp.cache_seqlens[0] + dp.seqlen_new;
  p.nq = p.nk = n;
  p.hq = dp.hq;
  p.hkv = dp.hkv;
  p.d = dp.d;
  p.tau = dp.tau;
  p.bq = static_cast<int>(dp.sq);
  p.bk = dp.bk;
  p.q = randn(n * dp.hq * dp.d, 99);
  std::copy(dp.q.begin(), dp.q.end(), p.q.begin() + (n - dp.sq) * dp.hq * dp.d);
  p.k.assign(after.k_after.begin(), after.k_after.begin() + n * dp.hkv * dp.d);
  p.v.assign(after.v_after.begin(), after.v_after.begin() + n * dp.hkv * dp.d);
  p.dout.assign(p.q.size(), 0.f);
  return p;
}

DecodeProblem base_problem(float tau) {
  DecodeProblem p;
  p.sq = 4;
  p.seqlen_new = 4;
  p.hq = 4;
  p.hkv = 2;
  p.capacity = 512;
  p.cache_seqlens = {508};  // 508 + 4 new keys = 512 = 16 tiles of 32
  p.tau = tau;
  p.bq = 4;
  p.bk = 32;
  p.randomize(5, 8.f);
  return p;
}

TEST(Decode, OneSplitEqualsForwardLastRowsBitForBit) {
  for (mala::SplitRule rule : {mala::SplitRule::per_split, mala::SplitRule::seeded})
  for (float tau : {0.f, 1.f, 4.f}) {
    DecodeProblem dp = base_problem(tau);
    dp.split_rule = rule;  // one split: both rules are the forward rule
    DecodeOut d = run_decode(dp);
    Problem fp = forward_twin(dp, d);
    ForwardOut f = run_forward(fp);
    const int64_t n = fp.nq, last_tile = f.n_q_tiles - 1;
    int64_t skipped = 0;
    for (int64_t h = 0; h < dp.hq; ++h) {
      for (int64_t t = 0; t < dp.sq; ++t) {
        const int64_t row = n - dp.sq + t;
        ASSERT_EQ(d.lse[h * dp.sq + t], f.lse[h * n + row]) << "tau=" << tau << " h=" << h << " t=" << t;
        ASSERT_EQ(d.slots[h * dp.sq + t], f.slots[h * n + row]);
        for (int64_t x = 0; x < dp.d; ++x)
          ASSERT_EQ(d.o[(t * dp.hq + h) * dp.d + x], f.o[(row * dp.hq + h) * dp.d + x]);
      }
      for (int64_t j = 0; j < d.n_k_tiles; ++j) {
        ASSERT_EQ(d.mask[h * d.n_k_tiles + j], f.mask[(h * f.n_q_tiles + last_tile) * f.n_k_tiles + j]);
        skipped += d.mask[h * d.n_k_tiles + j] == mala::kTileSkipped;
      }
    }
    if (tau >= 1.f) EXPECT_GT(skipped, 0) << "tau=" << tau << ": the test must exercise skipping";
  }
}

TEST(Decode, MoreSplitsRetainAtLeastAsMuchAndAgree) {
  for (float tau : {0.f, 1.f, 4.f}) {
    DecodeProblem dp = base_problem(tau);
    const DecodeOut one = run_decode(dp);
    for (int splits : {2, 3, 5, 16, 40}) {
      dp.num_splits = splits;
      DecodeOut many = run_decode(dp);
      int64_t extra = 0;
      for (size_t x = 0; x < one.mask.size(); ++x) {
        if (one.mask[x] == mala::kTileRetained) ASSERT_EQ(many.mask[x], mala::kTileRetained) << splits << " splits";
        extra += many.mask[x] == mala::kTileRetained && one.mask[x] != mala::kTileRetained;
      }
      if (tau == 0.f) {
        EXPECT_LT(rel_l2(many.o, one.o), 1e-6) << splits;
        for (size_t r = 0; r < one.lse.size(); ++r) EXPECT_NEAR(many.lse[r], one.lse[r], 1e-5);
      } else {
        // More retained mass: lse can only grow, and O stays within the tolerance of 1 split.
        for (size_t r = 0; r < one.lse.size(); ++r) EXPECT_GE(many.lse[r], one.lse[r] - 1e-5f);
        EXPECT_LT(rel_l2(many.o, one.o), 0.5) << splits;
      }
      for (size_t r = 0; r < one.slots.size(); ++r) EXPECT_GE(many.slots[r], one.slots[r]);
      if (splits == 16 && tau > 0) EXPECT_GT(extra, 0) << "one tile per split: the first tile of each split is kept";
    }
  }
}

TEST(Decode, PagedEqualsContiguousAndAppends) {
  for (bool pack : {false, true}) {
    DecodeProblem dp = base_problem(1.f);
    dp.batch = 2;
    dp.cache_seqlens = {300, 37};
    dp.pack_gqa = pack;
    dp.bq = 16;
    dp.randomize(8, 3.f);
    dp.num_splits = 3;
    const DecodeOut contiguous = run_decode(dp);
    dp.page_size = 16;
    const DecodeOut paged = run_decode(dp);
    EXPECT_EQ(paged.o, contiguous.o);
    EXPECT_EQ(paged.lse, contiguous.lse);
    EXPECT_EQ(paged.slots, contiguous.slots);
    EXPECT_EQ(paged.mask, contiguous.mask);
    EXPECT_EQ(paged.k_after, contiguous.k_after);
    EXPECT_EQ(paged.v_after, contiguous.v_after);
    // The new keys sit at cache_seqlens[b] .. + seqlen_new; nothing else changed.
    const int64_t row = dp.hkv * dp.d;
    for (int64_t b = 0; b < dp.batch; ++b)
      for (int64_t pos = 0; pos < dp.capacity; ++pos)
        for (int64_t x = 0; x < row; ++x) {
          const int64_t at = (b * dp.capacity + pos) * row + x;
          const int64_t t = pos - dp.cache_seqlens[b];
          const float want_k = (t >= 0 && t < dp.seqlen_new) ? dp.k_new[(b * dp.seqlen_new + t) * row + x] : dp.k_cache[at];
          const float want_v = (t >= 0 && t < dp.seqlen_new) ? dp.v_new[(b * dp.seqlen_new + t) * row + x] : dp.v_cache[at];
          ASSERT_EQ(paged.k_after[at], want_k) << "b=" << b << " pos=" << pos;
          ASSERT_EQ(paged.v_after[at], want_v) << "b=" << b << " pos=" << pos;
        }
  }
}

// Sequences of different cache lengths in one batch equal each sequence run alone; rows that
// see no key (seqlen_q > keys) give zeros and lse = -inf.
TEST(Decode, BatchWithDifferentLengthsEqualsSequencesAlone) {
  for (bool pack : {false, true}) {
    DecodeProblem dp;
    dp.batch = 3;
    dp.sq = 3;
    dp.seqlen_new = 1;
    dp.hq = 4;
    dp.hkv = 1;
    dp.capacity = 200;
    dp.cache_seqlens = {150, 0, 77};  // sequence 1: one key, rows 0 and 1 see nothing
    dp.pack_gqa = pack;
    dp.bq = 8;
    dp.bk = 16;
    dp.num_splits = 2;
    dp.randomize(12, 3.f);
    const DecodeOut all = run_decode(dp);
    const int64_t qs = dp.sq * dp.hq * dp.d, cs = dp.capacity * dp.hkv * dp.d, ns = dp.seqlen_new * dp.hkv * dp.d;
    for (int64_t b = 0; b < dp.batch; ++b) {
      DecodeProblem one = dp;
      one.batch = 1;
      one.cache_seqlens = {dp.cache_seqlens[b]};
      one.q.assign(dp.q.begin() + b * qs, dp.q.begin() + (b + 1) * qs);
      one.k_cache.assign(dp.k_cache.begin() + b * cs, dp.k_cache.begin() + (b + 1) * cs);
      one.v_cache.assign(dp.v_cache.begin() + b * cs, dp.v_cache.begin() + (b + 1) * cs);
      one.k_new.assign(dp.k_new.begin() + b * ns, dp.k_new.begin() + (b + 1) * ns);
      one.v_new.assign(dp.v_new.begin() + b * ns, dp.v_new.begin() + (b + 1) * ns);
      const DecodeOut alone = run_decode(one);
      EXPECT_EQ(alone.o, std::vector<float>(all.o.begin() + b * qs, all.o.begin() + (b + 1) * qs)) << b;
      const int64_t ls = dp.hq * dp.sq;
      EXPECT_EQ(alone.lse, std::vector<float>(all.lse.begin() + b * ls, all.lse.begin() + (b + 1) * ls)) << b;
      EXPECT_EQ(alone.slots, std::vector<int32_t>(all.slots.begin() + b * ls, all.slots.begin() + (b + 1) * ls)) << b;
      const size_t ms = alone.mask.size();
      EXPECT_EQ(alone.mask, std::vector<uint8_t>(all.mask.begin() + b * ms, all.mask.begin() + (b + 1) * ms)) << b;
    }
    // Sequence 1 has one key: rows 0, 1 see nothing, row 2 sees key 0 with weight 1.
    for (int64_t h = 0; h < dp.hq; ++h) {
      for (int64_t t = 0; t < 2; ++t) {
        EXPECT_EQ(all.lse[(1 * dp.hq + h) * dp.sq + t], -INFINITY);
        EXPECT_EQ(all.slots[(1 * dp.hq + h) * dp.sq + t], 0);
        for (int64_t x = 0; x < dp.d; ++x) EXPECT_EQ(all.o[((1 * dp.sq + t) * dp.hq + h) * dp.d + x], 0.f);
      }
      for (int64_t x = 0; x < dp.d; ++x)
        EXPECT_NEAR(all.o[((1 * dp.sq + 2) * dp.hq + h) * dp.d + x], dp.v_new[1 * dp.d + x], 1e-6);
    }
  }
}

// Packed GQA with one token: the G query heads of a KV head form one tile of G rows that all see
// every key — the same computation as a non-causal forward with G query rows and one head.
TEST(Decode, PackedGqaEqualsForwardOverPackedRows) {
  for (float tau : {0.f, 1.f}) {
    DecodeProblem dp;
    dp.sq = 1;
    dp.hq = 8;
    dp.hkv = 2;
    dp.capacity = 400;
    dp.cache_seqlens = {400};
    dp.pack_gqa = true;
    dp.bq = 64;
    dp.bk = 64;
    dp.tau = tau;
    dp.randomize(31, 3.f);
    const DecodeOut d = run_decode(dp);
    for (int64_t hk = 0; hk < dp.hkv; ++hk) {
      Problem p;
      p.nq = 4;
      p.nk = 400;
      p.d = dp.d;
      p.causal = false;
      p.tau = tau;
      p.bq = 64;
      p.bk = 64;
      p.q.assign(dp.q.begin() + hk * 4 * dp.d, dp.q.begin() + (hk + 1) * 4 * dp.d);
      p.k.resize(400 * dp.d);
      p.v.resize(400 * dp.d);
      for (int64_t pos = 0; pos < 400; ++pos)
        for (int64_t x = 0; x < dp.d; ++x) {
          p.k[pos * dp.d + x] = dp.k_cache[(pos * dp.hkv + hk) * dp.d + x];
          p.v[pos * dp.d + x] = dp.v_cache[(pos * dp.hkv + hk) * dp.d + x];
        }
      p.dout.assign(p.q.size(), 0.f);
      const ForwardOut f = run_forward(p);
      for (int64_t g = 0; g < 4; ++g) {
        const int64_t h = hk * 4 + g;
        ASSERT_EQ(d.lse[h], f.lse[g]);
        ASSERT_EQ(d.slots[h], f.slots[g]);
        for (int64_t x = 0; x < dp.d; ++x) ASSERT_EQ(d.o[h * dp.d + x], f.o[g * dp.d + x]);
      }
      for (int64_t j = 0; j < d.n_k_tiles; ++j) ASSERT_EQ(d.mask[hk * d.n_k_tiles + j], f.mask[j]);
    }
  }
}

}  // namespace

#include "common/layout.h"

namespace {

// bf16 / f16 decode = fp32 decode on the rounded inputs, outputs rounded once; the appended keys
// are the raw 16-bit words.
TEST(Decode, SixteenBitEqualsFp32OnRoundedInputs) {
  for (mala::DType t : {mala::DType::bf16, mala::DType::f16}) {
    DecodeProblem dp = base_problem(1.f);
    dp.num_splits = 3;
    dp.pack_gqa = true;
    dp.bq = 16;
    auto round = [&](std::vector<float>& x) {
      std::vector<uint16_t> bits(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        bits[i] = t == mala::DType::f16 ? mala::layout::float_to_half(x[i]) : mala::layout::float_to_bf16(x[i]);
        x[i] = t == mala::DType::f16 ? mala::layout::half_to_float(bits[i]) : mala::layout::bf16_to_float(bits[i]);
      }
      return bits;
    };
    auto q = round(dp.q), kc = round(dp.k_cache), vc = round(dp.v_cache), kn = round(dp.k_new), vn = round(dp.v_new);
    const DecodeOut ref = run_decode(dp);
    mala::DecodeArgs a;
    a.dtype = t;
    a.q = q.data();
    a.k_cache = kc.data();
    a.v_cache = vc.data();
    a.k_new = kn.data();
    a.v_new = vn.data();
    a.cache_seqlens = dp.cache_seqlens.data();
    a.cache_capacity = dp.capacity;
    a.seqlen_q = dp.sq;
    a.seqlen_new = dp.seqlen_new;
    a.heads_q = dp.hq;
    a.heads_kv = dp.hkv;
    a.head_dim = dp.d;
    a.tau = dp.tau;
    a.block_q = dp.bq;
    a.block_k = dp.bk;
    a.num_splits = dp.num_splits;
    a.pack_gqa = true;
    std::vector<uint16_t> o(ref.o.size());
    std::vector<float> lse(ref.lse.size());
    a.o = o.data();
    a.lse = lse.data();
    ASSERT_TRUE(mala::decode(a).ok);
    EXPECT_EQ(lse, ref.lse);
    for (size_t i = 0; i < o.size(); ++i) {
      const uint16_t want = t == mala::DType::f16 ? mala::layout::float_to_half(ref.o[i]) : mala::layout::float_to_bf16(ref.o[i]);
      ASSERT_EQ(o[i], want) << i;
    }
    const int64_t row = dp.hkv * dp.d;
    for (int64_t x = 0; x < dp.seqlen_new * row; ++x) ASSERT_EQ(kc[dp.cache_seqlens[0] * row + x], kn[x]);
  }
}

}  // namespace

namespace {

// Strided q / o / cache / new tensors give the contiguous results; non-causal decode sees all keys.
TEST(Decode, StridedEqualsContiguousAndNonCausal) {
  for (bool causal : {true, false}) {
    DecodeProblem dp = base_problem(1.f);
    dp.causal = causal;
    dp.num_splits = 2;
    const DecodeOut ref = run_decode(dp);
    const int64_t d = dp.d, hq = dp.hq, hkv = dp.hkv, sq = dp.sq, cap = dp.capacity, nn = dp.seqlen_new;
    const mala::Strides qs{hq * sq * d, d, sq * d};                 // [b, h, s, d]
    const mala::Strides os{0, hq * (d + 4), d + 4};                   // padded heads
    const mala::Strides cs{0, hkv * d + 8, 0};                        // padded cache rows
    const mala::Strides ns{0, 0, 0};
    std::vector<float> q(hq * sq * d), o(sq * hq * (d + 4), -5.f);
    std::vector<float> kc(cap * (hkv * d + 8), -9.f), vc(cap * (hkv * d + 8), -9.f);
    for (int64_t t = 0; t < sq; ++t)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t x = 0; x < d; ++x) q[t * qs.row + h * qs.head + x] = dp.q[(t * hq + h) * d + x];
    for (int64_t pos = 0; pos < cap; ++pos)
      for (int64_t x = 0; x < hkv * d; ++x) {
        kc[pos * cs.row + x] = dp.k_cache[pos * hkv * d + x];
        vc[pos * cs.row + x] = dp.v_cache[pos * hkv * d + x];
      }
    mala::DecodeArgs a;
    a.q = q.data();
    a.k_cache = kc.data();
    a.v_cache = vc.data();
    a.k_new = dp.k_new.data();
    a.v_new = dp.v_new.data();
    a.cache_seqlens = dp.cache_seqlens.data();
    a.cache_capacity = cap;
    a.seqlen_q = sq;
    a.seqlen_new = nn;
    a.heads_q = hq;
    a.heads_kv = hkv;
    a.head_dim = d;
    a.tau = dp.tau;
    a.causal = causal;
    a.block_q = dp.bq;
    a.block_k = dp.bk;
    a.num_splits = dp.num_splits;
    a.pack_gqa = dp.pack_gqa;
    a.q_strides = qs;
    a.o_strides = os;
    a.k_cache_strides = a.v_cache_strides = cs;
    a.k_new_strides = a.v_new_strides = ns;
    std::vector<float> lse(ref.lse.size());
    a.o = o.data();
    a.lse = lse.data();
    ASSERT_TRUE(mala::decode(a).ok);
    EXPECT_EQ(lse, ref.lse);
    for (int64_t t = 0; t < sq; ++t)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t x = 0; x < d; ++x) ASSERT_EQ(o[t * os.row + h * os.head + x], ref.o[(t * hq + h) * d + x]);
    EXPECT_EQ(o[d], -5.f) << "padding untouched";
    EXPECT_EQ(kc[hkv * d], -9.f) << "cache padding untouched";
    if (!causal) {
      // Every row sees all Nk keys: the last query tile's key tiles are all legal for every token.
      for (uint8_t m : ref.mask) EXPECT_NE(m, mala::kTileIllegal);
    }
  }
}

}  // namespace

// ---- seeded split-KV (docs/spec.md, "Split rules") ---------------------------------------------
namespace {

// A decode problem on the synthetic workload (locality, a sink, needles): sequence b's cache is
// the workload's first lens[b] keys and its sq tokens are the workload's queries at the cache's end.
DecodeProblem structured_problem(const std::vector<int32_t>& lens, int64_t sq, int64_t hq, int64_t hkv, int64_t d,
                                 double sharpness, uint64_t seed) {
  DecodeProblem p;
  p.batch = static_cast<int64_t>(lens.size());
  p.sq = sq;
  p.hq = hq;
  p.hkv = hkv;
  p.d = d;
  p.capacity = *std::max_element(lens.begin(), lens.end());
  p.cache_seqlens = lens;
  mala::WorkloadSpec w;
  w.batch = p.batch, w.seqlen = p.capacity, w.heads_q = hq, w.heads_kv = hkv, w.head_dim = d;
  w.sharpness = sharpness, w.seed = seed;
  std::vector<float> q(p.batch * p.capacity * hq * d);
  p.k_cache.resize(p.batch * p.capacity * hkv * d);
  p.v_cache.resize(p.k_cache.size());
  EXPECT_TRUE(mala::make_workload(w, q.data(), p.k_cache.data(), p.v_cache.data(), nullptr).ok);
  p.q.resize(p.batch * sq * hq * d);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < sq; ++t) {
      const int64_t pos = std::max<int64_t>(0, lens[b] - sq + t);
      std::copy_n(&q[((b * p.capacity + pos) * hq) * d], hq * d, &p.q[((b * sq + t) * hq) * d]);
    }
  return p;
}

// Every query tile of a seeded run with > 1 split retains its anchors: key tile 0 and its newest
// legal tile (the last tile that is not kTileIllegal).
void expect_anchors_retained(const DecodeOut& o, const std::string& what) {
  const int64_t nkt = o.n_k_tiles;
  for (size_t base = 0; base < o.mask.size(); base += static_cast<size_t>(nkt)) {
    int64_t newest = -1;
    for (int64_t j = 0; j < nkt; ++j)
      if (o.mask[base + j] != mala::kTileIllegal) newest = j;
    if (newest < 0) continue;
    ASSERT_EQ(o.mask[base], mala::kTileRetained) << what << ": tile 0 of query tile " << base / nkt;
    ASSERT_EQ(o.mask[base + newest], mala::kTileRetained) << what << ": newest tile of query tile " << base / nkt;
  }
}

// The guarantee over thousands of rows: with the seeded rule, every row's omitted dense mass
// 1 - exp(lse - lse_dense) is at most tau / (1 + tau), no row is empty, anchors are retained; random
// and structured inputs, several split counts, packed and unpacked, a few tokens per sequence.
TEST(DecodeSeeded, OmittedMassWithinBoundOverThousandsOfRows) {
  int64_t rows_checked = 0, skipped_tiles = 0;
  double worst = 0;  // largest omitted / bound
  for (bool structured : {false, true})
    for (uint64_t seed : {1, 2}) {
      const std::vector<int32_t> lens = {2100, 1500, 900, 333, 64, 17};
      DecodeProblem dp = structured ? structured_problem(lens, 3, 8, 2, 32, 2.0 + seed, seed)
                                    : DecodeProblem{};
      if (!structured) {
        dp.batch = static_cast<int64_t>(lens.size());
        dp.sq = 3, dp.hq = 8, dp.hkv = 2, dp.d = 32, dp.capacity = 2100;
        dp.cache_seqlens = lens;
        dp.randomize(40 + seed, 2.5f);
      }
      dp.pack_gqa = seed == 1;
      dp.bq = 8;
      dp.bk = 16;  // 132 key tiles at 2100 keys: kMaxNumSplits = 128 splits of one or two tiles
      dp.tau = 0.f;
      const DecodeOut dense = run_decode(dp);
      for (float tau : {0.5f, 1.f, 2.f})
        for (int splits : {2, 4, 16, mala::kMaxNumSplits}) {
          dp.tau = tau;
          dp.num_splits = splits;
          dp.split_rule = mala::SplitRule::seeded;
          const DecodeOut o = run_decode(dp);
          const std::string what = std::string(structured ? "structured" : "random") + " seed=" +
                                   std::to_string(seed) + " tau=" + std::to_string(tau) +
                                   " splits=" + std::to_string(splits);
          const double bound = tau / (1.0 + tau);
          for (size_t r = 0; r < o.lse.size(); ++r) {
            ASSERT_TRUE(std::isfinite(o.lse[r])) << what << " row " << r << ": no row may end empty";
            ASSERT_GT(o.slots[r], 0) << what << " row " << r;
            const double omitted = 1.0 - std::exp(static_cast<double>(o.lse[r]) - dense.lse[r]);
            ASSERT_LE(omitted, bound + 1e-5) << what << " row " << r;
            worst = std::max(worst, omitted / bound);
            ++rows_checked;
          }
          for (uint8_t m : o.mask) skipped_tiles += m == mala::kTileSkipped;
          expect_anchors_retained(o, what);
        }
    }
  std::printf("[seeded] %lld rows, %lld skipped tiles, worst omitted mass = %.3f of the bound\n",
              static_cast<long long>(rows_checked), static_cast<long long>(skipped_tiles), worst);
  EXPECT_GE(rows_checked, 5000);
  EXPECT_GT(skipped_tiles, 1000) << "the property must be exercised with skipping";
  EXPECT_GT(worst, 0.01) << "skipping must omit some mass";
}

// tau = 0: both rules are dense attention at any split count.
TEST(DecodeSeeded, TauZeroIsDenseForBothRules) {
  DecodeProblem dp = structured_problem({700, 300}, 2, 4, 1, 32, 3.0, 7);
  dp.bk = 16;
  dp.bq = 8;
  dp.pack_gqa = true;
  dp.tau = 0.f;
  const DecodeOut one = run_decode(dp);
  for (mala::SplitRule rule : {mala::SplitRule::per_split, mala::SplitRule::seeded})
    for (int splits : {1, 3, 44}) {
      dp.split_rule = rule;
      dp.num_splits = splits;
      const DecodeOut o = run_decode(dp);
      for (uint8_t m : o.mask) ASSERT_NE(m, mala::kTileSkipped) << mala::split_rule_name(rule) << " " << splits;
      EXPECT_EQ(o.slots, one.slots);
      EXPECT_LT(rel_l2(o.o, one.o), 1e-6);
      for (size_t r = 0; r < one.lse.size(); ++r) EXPECT_NEAR(o.lse[r], one.lse[r], 1e-5);
    }
}

// A long structured cache: the per-split rule keeps nearly every tile with many splits, the seeded
// rule stays near the unsplit forward rule.  Work is counted where a tile is retained (an anchor
// scored by a split that does not own it is not that split's work): slots = retained tiles * Bk.
TEST(DecodeSeeded, LongCacheRetainsFarLessThanPerSplit) {
  const int32_t n = 32768;
  DecodeProblem dp = structured_problem({n}, 1, 4, 1, 64, 3.0, 3);
  dp.pack_gqa = true;
  dp.tau = 0.f;
  const DecodeOut dense = run_decode(dp);
  dp.tau = 1.f;
  auto fraction = [&](int splits, mala::SplitRule rule, double* slots_per_row) {
    dp.num_splits = splits;
    dp.split_rule = rule;
    const DecodeOut o = run_decode(dp);
    for (size_t r = 0; r < o.lse.size(); ++r)
      EXPECT_LE(1.0 - std::exp(static_cast<double>(o.lse[r]) - dense.lse[r]), 0.5 + 1e-5);
    int64_t retained = 0;
    for (uint8_t m : o.mask) retained += m == mala::kTileRetained;
    const int64_t bk = ceil_div(n, o.n_k_tiles);
    for (int32_t s : o.slots) EXPECT_EQ(s, retained * bk) << mala::split_rule_name(rule) << " " << splits;
    if (rule == mala::SplitRule::seeded && splits > 1) expect_anchors_retained(o, "long cache");
    *slots_per_row = static_cast<double>(o.slots[0]);
    return mala::retained_fraction(o.mask.data(), static_cast<int64_t>(o.mask.size()));
  };
  double slots = 0;
  const double unsplit = fraction(1, mala::SplitRule::per_split, &slots);
  // The seeded splits can keep less than the unsplit rule: their denominators hold the newest tile
  // and the sink tile 0 from the start, which the unsplit rule reaches last.
  std::printf("[seeded] N=%d Hq=4 Hkv=1 d=64 tau=1: unsplit forward rule keeps %.2f%% of tiles\n", n, 100 * unsplit);
  for (int splits : {16, mala::kMaxNumSplits}) {
    const double per = fraction(splits, mala::SplitRule::per_split, &slots);
    const double seeded = fraction(splits, mala::SplitRule::seeded, &slots);
    std::printf("[seeded]   %3d splits: per_split keeps %.2f%%, seeded keeps %.2f%%\n", splits, 100 * per,
                100 * seeded);
    EXPECT_LT(seeded * 4, per) << splits << " splits";
    EXPECT_LE(seeded, unsplit + 2.0 * splits / 256 + 0.02) << splits << " splits";
  }
}

// seeded is the default, and the CUDA decode takes both rules at any split count: the argument
// checks (which run before any device query, so this runs without a GPU) name split_rule only for
// an unknown value.
TEST(DecodeSeeded, DefaultAndCudaAcceptsBothRules) {
  EXPECT_EQ(mala::DecodeArgs{}.split_rule, mala::SplitRule::seeded);
  DecodeProblem dp = base_problem(1.f);
  const int64_t d = 128;  // a head dim the CUDA decode has
  std::vector<uint16_t> q(dp.sq * dp.hq * d), kc(dp.capacity * dp.hkv * d), vc(kc.size()), o(q.size(), 0x7777);
  mala::DecodeArgs a;
  a.device = mala::Device::cuda;
  a.dtype = mala::DType::bf16;
  a.q = q.data();
  a.k_cache = kc.data();
  a.v_cache = vc.data();
  a.o = o.data();
  a.cache_seqlens = dp.cache_seqlens.data();
  a.cache_capacity = dp.capacity;
  a.seqlen_q = dp.sq;
  a.heads_q = dp.hq;
  a.heads_kv = dp.hkv;
  a.head_dim = d;
  // Here they fail later, at the device (no GPU or no CUDA build; host memory), or not at all.
  for (mala::SplitRule rule : {mala::SplitRule::seeded, mala::SplitRule::per_split})
    for (int splits : {0, 1, 2, mala::kMaxNumSplits}) {
      a.split_rule = rule;
      a.num_splits = splits;
      EXPECT_NE(mala::check(a).message.rfind("split_rule", 0), 0u) << mala::split_rule_name(rule) << " " << splits;
    }
  // An unknown value is named on every device.
  a.split_rule = static_cast<mala::SplitRule>(7);
  EXPECT_EQ(mala::check(a).message.rfind("split_rule: must be per_split or seeded", 0), 0u);
  a.device = mala::Device::cpu;
  EXPECT_EQ(mala::check(a).message.rfind("split_rule", 0), 0u);
}

}  // namespace

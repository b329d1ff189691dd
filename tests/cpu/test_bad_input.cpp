// Bad input found by the review of issue #64, one test per defect: varlen offsets past q (D3),
// num_splits (D2), NaN queries (D1), overflowing sizes (D5), allocation failure (D6), aliased
// caches when appending (D10) and the argument an error names (D11).  Each refused call must
// write nothing (outputs keep a sentinel); each test fails on the code before the fix.  The CI
// runs this file under AddressSanitizer + UBSan too (scripts/sanitize.sh), which turns a
// read or write past a buffer, or a wrapped signed size, into a failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "test_util.h"

using namespace mala_test;

namespace {

constexpr float kSentinel = 12345.f;

bool starts_with(const mala::Status& s, const std::string& prefix) {
  return !s.ok && s.message.rfind(prefix, 0) == 0;
}

bool all_equal(const std::vector<float>& x, float v) {
  for (float e : x)
    if (!(e == v)) return false;
  return true;
}

bool all_nan(const std::vector<float>& x) {
  for (float e : x)
    if (!std::isnan(e)) return false;
  return true;
}

// A pointer that is never dereferenced: the checks look at addresses only.
void* fake(uint64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }

// ---- D3: cu_seqlens_q[batch] past q's rows ------------------------------------------------------

TEST(BadInput, VarlenOffsetsPastTotalQAreRefusedAndNothingWritten) {
  // q has 10 rows but cu_seqlens_q says 12: without total_q the CPU gather read past q and the
  // scatter wrote past o.
  const int64_t rows = 10, h = 1, d = 16;
  std::vector<float> q = randn(rows * h * d, 1), k = randn(rows * h * d, 2), v = randn(rows * h * d, 3);
  std::vector<float> o(rows * h * d, kSentinel), lse(rows * h, kSentinel);
  const int32_t cu_q[] = {0, 12}, cu_k[] = {0, 10};
  mala::ForwardArgs a;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.o = o.data();
  a.lse = lse.data();
  a.batch = 1;
  a.seqlen_q = 12;
  a.seqlen_k = 10;
  a.head_dim = d;
  a.cu_seqlens_q = cu_q;
  a.cu_seqlens_k = cu_k;
  a.total_q = rows;
  a.total_k = rows;
  const mala::Status s = mala::forward(a);
  EXPECT_TRUE(starts_with(s, "cu_seqlens_q:")) << s.message;
  EXPECT_NE(s.message.find("total_q = 10"), std::string::npos) << s.message;
  EXPECT_TRUE(all_equal(o, kSentinel));
  EXPECT_TRUE(all_equal(lse, kSentinel));

  // The same for k (D11: the message names cu_seqlens_k, the argument that is wrong, not total_k).
  const int32_t cu_q_ok[] = {0, 10}, cu_k_bad[] = {0, 12};
  a.cu_seqlens_q = cu_q_ok;
  a.cu_seqlens_k = cu_k_bad;
  a.seqlen_q = 10;
  a.seqlen_k = 10;
  const mala::Status sk = mala::forward(a);
  EXPECT_TRUE(starts_with(sk, "cu_seqlens_k:")) << sk.message;
  EXPECT_TRUE(all_equal(o, kSentinel));

  // In bounds, total_q given: runs.
  a.cu_seqlens_k = cu_k;
  EXPECT_TRUE(mala::forward(a).ok);
  EXPECT_FALSE(all_equal(o, kSentinel));
}

// ---- D2: num_splits bounded ------------------------------------------------------------------------

mala::DecodeArgs small_decode(const std::vector<float>& q, std::vector<float>& kc, std::vector<float>& vc,
                              std::vector<float>& o, std::vector<float>& lse, const int32_t* lens, int64_t cap,
                              int64_t d) {
  mala::DecodeArgs a;
  a.q = q.data();
  a.k_cache = kc.data();
  a.v_cache = vc.data();
  a.o = o.data();
  a.lse = lse.data();
  a.cache_seqlens = lens;
  a.cache_capacity = cap;
  a.head_dim = d;
  return a;
}

TEST(BadInput, NumSplitsAboveTheBoundIsRefused) {
  const int64_t cap = 300, d = 16;
  std::vector<float> q = randn(d, 1), kc = randn(cap * d, 2), vc = randn(cap * d, 3);
  std::vector<float> o(d, kSentinel), lse(1, kSentinel);
  const int32_t lens[] = {100};
  mala::DecodeArgs a = small_decode(q, kc, vc, o, lse, lens, cap, d);
  // 2^31 - 1 splits overflowed n_tiles + num_splits - 1 in rule::split_tiles: every split empty,
  // o = 0 and lse = -inf with an ok Status, after minutes of empty splits.
  for (int splits : {mala::kMaxNumSplits + 1, 0x7fffffff}) {
    a.num_splits = splits;
    const mala::Status s = mala::decode(a);
    EXPECT_TRUE(starts_with(s, "num_splits:")) << splits << ": " << s.message;
    EXPECT_TRUE(all_equal(o, kSentinel));
  }
  a.num_splits = mala::kMaxNumSplits;
  const mala::Status s = mala::decode(a);
  ASSERT_TRUE(s.ok) << s.message;
  EXPECT_TRUE(std::isfinite(lse[0]));
}

// ---- D1: NaN propagates ------------------------------------------------------------------------------

TEST(BadInput, NanQueryGivesNanInForwardAtEveryTau) {
  // N = 1 (the query tile is the NaN row alone), an all-NaN head, and a NaN row among finite ones.
  for (float tau : {0.f, 1.f}) {
    for (int64_t nq : {1, 40}) {
      Problem p;
      p.nq = nq;
      p.nk = 300;
      p.hq = 2;
      p.d = 16;
      p.tau = tau;
      p.bq = 16;
      p.bk = 32;
      p.randomize(7);
      p.q[0] = NAN;  // row 0 of head 0
      if (nq > 1)
        for (int64_t r = 0; r < nq; ++r) p.q[(r * p.hq + 1) * p.d + 3] = NAN;  // all of head 1
      const ForwardOut f = run_forward(p);
      const std::string what = "tau=" + std::to_string(tau) + " nq=" + std::to_string(nq);
      for (int64_t x = 0; x < p.d; ++x) EXPECT_TRUE(std::isnan(f.o[x])) << what << " o[0, 0, " << x << "]";
      EXPECT_TRUE(std::isnan(f.lse[0])) << what << " lse of the NaN row is " << f.lse[0];
      if (nq > 1) {
        for (int64_t r = 0; r < nq; ++r) EXPECT_TRUE(std::isnan(f.lse[nq + r])) << what << " head 1 row " << r;
        EXPECT_TRUE(std::isfinite(f.lse[1])) << what << ": a finite row of head 0 stays finite";
      }
      // The backward of the NaN row: NaN gradients, not zeros.
      const BackwardOut b = run_backward(p, f);
      EXPECT_TRUE(std::isnan(b.dq[0])) << what << " dq[0] = " << b.dq[0];
    }
  }
}

TEST(BadInput, NanQueryGivesNanInDecodeAtEverySplitCount) {
  const int64_t cap = 300, d = 16;
  std::vector<float> q = randn(d, 1), kc = randn(cap * d, 2), vc = randn(cap * d, 3);
  q[0] = NAN;
  const int32_t lens[] = {100};
  for (float tau : {0.f, 1.f})
    for (int splits : {1, 3})
      for (mala::SplitRule rule : {mala::SplitRule::seeded, mala::SplitRule::per_split}) {
        std::vector<float> o(d, kSentinel), lse(1, kSentinel);
        mala::DecodeArgs a = small_decode(q, kc, vc, o, lse, lens, cap, d);
        a.tau = tau;
        a.block_k = 32;
        a.num_splits = splits;
        a.split_rule = rule;
        const mala::Status s = mala::decode(a);
        ASSERT_TRUE(s.ok) << s.message;
        EXPECT_TRUE(all_nan(o)) << "tau=" << tau << " splits=" << splits << ": o[0] = " << o[0];
        EXPECT_TRUE(std::isnan(lse[0])) << "tau=" << tau << " splits=" << splits << ": lse = " << lse[0];
      }
}

TEST(BadInput, NanScoreInOneTileIsRetainedNotSkipped) {
  // A NaN key in an old tile: the row max of that tile is NaN, which must not pass the skip test.
  Problem p;
  p.nq = 1;
  p.nk = 256;
  p.d = 16;
  p.bq = 16;
  p.bk = 32;
  p.randomize(9);
  // Tile 0's keys point away from q (scores near -12, the others near 0): the tile is skipped at
  // tau = 1 unless its max sees the NaN of key 5.
  for (int64_t key = 0; key < 32; ++key)
    for (int64_t x = 0; x < p.d; ++x) p.k[key * p.d + x] = -3.f * p.q[x];
  ForwardOut clean = run_forward(p);
  ASSERT_EQ(clean.mask[0], mala::kTileSkipped) << "the test needs tile 0 skipped without the NaN";
  p.k[5 * p.d] = NAN;
  const ForwardOut f = run_forward(p);
  EXPECT_EQ(f.mask[0], mala::kTileRetained);
  EXPECT_TRUE(std::isnan(f.lse[0]));
}

// The backward pattern the GPU tests (tests/gpu/test_bad_input.cpp) expect of every kernel: one NaN
// query row gives NaN dq for that row alone and NaN dk, dv for exactly the keys it sees; one NaN key
// gives NaN o, lse and dq for exactly the rows that see it, and NaN dk, dv for every key (the last
// row sees them all).  Causal, GQA (2 query heads on 1 KV head), tau 0 and 1.
TEST(BadInput, NanQueryRowOrKeyGivesNanGradientsWhereItIsSeen) {
  constexpr int64_t kRow = 40, kKey = 50;
  for (bool key : {false, true})
    for (float tau : {0.f, 1.f}) {
      Problem p;
      p.nq = p.nk = 96;
      p.hq = 2;
      p.hkv = 1;
      p.d = 16;
      p.tau = tau;
      p.bq = 16;
      p.bk = 32;
      p.randomize(21);
      if (key)
        p.k[kKey * p.d + 2] = NAN;
      else
        p.q[(kRow * p.hq + 0) * p.d + 2] = NAN;
      const ForwardOut f = run_forward(p);
      const BackwardOut b = run_backward(p, f);
      const std::string what = std::string(key ? "NaN key" : "NaN query") + " tau=" + std::to_string(tau);
      auto row_is = [&](const std::vector<float>& x, int64_t row, bool nan) {
        for (int64_t i = 0; i < p.d; ++i)
          if (std::isnan(x[row * p.d + i]) != nan) return false;
        return true;
      };
      for (int64_t h = 0; h < p.hq; ++h)
        for (int64_t r = 0; r < p.nq; ++r) {
          const bool nan = key ? r >= kKey : (r == kRow && h == 0);
          EXPECT_TRUE(row_is(f.o, r * p.hq + h, nan)) << what << " o head " << h << " row " << r;
          EXPECT_EQ(std::isnan(f.lse[h * p.nq + r]), nan) << what << " lse head " << h << " row " << r;
          EXPECT_TRUE(row_is(b.dq, r * p.hq + h, nan)) << what << " dq head " << h << " row " << r;
        }
      for (int64_t c = 0; c < p.nk; ++c) {
        const bool nan = key || c <= kRow;
        EXPECT_TRUE(row_is(b.dk, c, nan)) << what << " dk key " << c;
        EXPECT_TRUE(row_is(b.dv, c, nan)) << what << " dv key " << c;
      }
      // The NaN row's tiles that hold its legal keys are retained, in the forward and the backward.
      if (!key) {
        for (int64_t kt = 0; kt * p.bk <= kRow; ++kt) {
          EXPECT_EQ(f.mask[(0 * f.n_q_tiles + kRow / p.bq) * f.n_k_tiles + kt], mala::kTileRetained) << what << kt;
          EXPECT_EQ(b.mask[(0 * b.n_q_tiles + kRow / p.bq) * b.n_k_tiles + kt], mala::kTileRetained) << what << kt;
        }
      }
    }
}

// ---- D5: sizes that overflow int64 ---------------------------------------------------------------

mala::ForwardArgs fake_forward() {
  mala::ForwardArgs a;
  a.q = fake(0x10000);
  a.k = fake(1ull << 62);
  a.v = fake(1ull << 62 | 1ull << 61);
  a.o = fake(1ull << 63);
  a.seqlen_q = a.seqlen_k = 16;
  a.head_dim = 8;
  return a;
}

TEST(BadInput, OverflowingSizesAreRefusedByTheChecks) {
  {  // heads * head_dim wrapped in the stride defaults
    mala::ForwardArgs a = fake_forward();
    a.heads_q = a.heads_kv = int64_t(1) << 60;
    const mala::Status s = mala::check(a);
    EXPECT_TRUE(starts_with(s, "q:")) << s.message;
  }
  {  // a batch stride whose element extent fits but whose byte extent wraps
    mala::ForwardArgs a = fake_forward();
    a.batch = 2;
    a.v_strides.batch = (int64_t(1) << 62) - 1;
    const mala::Status s = mala::check(a);
    EXPECT_TRUE(starts_with(s, "v:")) << s.message;
  }
  {  // lse bytes: 4 * heads * rows wraps while q (float16, head_dim 1) fits
    mala::ForwardArgs a = fake_forward();
    a.dtype = mala::DType::f16;
    a.seqlen_q = 0x7fffffff;
    a.seqlen_k = 1;
    a.heads_q = (int64_t(1) << 30) + (int64_t(1) << 29);
    a.head_dim = 1;
    a.lse = static_cast<float*>(fake(0x1000));
    const mala::Status s = mala::check(a);
    EXPECT_TRUE(starts_with(s, "lse:")) << s.message;
  }
  {  // tile-mask bytes: 1 x 1 tiles over 2^31 x 2^31 scores
    mala::ForwardArgs a = fake_forward();
    a.seqlen_q = a.seqlen_k = 0x7fffffff;
    a.heads_q = a.heads_kv = 4;
    a.head_dim = 1;
    a.block_q = a.block_k = 1;
    a.tile_mask = static_cast<uint8_t*>(fake(0x1000));
    const mala::Status s = mala::check(a);
    EXPECT_TRUE(starts_with(s, "tile_mask:")) << s.message;
  }
  {  // page_size * max_pages = 2^64 wrapped to 0 and check() returned OK
    mala::DecodeArgs a;
    a.q = fake(0x10000);
    a.k_cache = fake(1ull << 61);
    a.v_cache = fake(1ull << 62);
    a.o = fake(1ull << 63);
    a.cache_seqlens = static_cast<const int32_t*>(fake(0x2000));
    a.block_table = static_cast<const int32_t*>(fake(0x3000));
    a.head_dim = 8;
    a.page_size = a.max_pages = int64_t(1) << 32;
    a.num_pages = 1;
    const mala::Status s = mala::check(a);
    EXPECT_TRUE(starts_with(s, "max_pages:")) << s.message;
  }
}

// ---- D6: allocation failure ------------------------------------------------------------------------

TEST(BadInput, FailedStagingAllocationIsAStatus) {
  // q of 2^31 - 1 rows x 256 heads x 512 fp32 = 2^50 bytes: valid arguments (the pointers are never
  // read: the fp32 staging copy of q is allocated first and cannot be).
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer's operator new reports an allocation this large and exits instead of throwing.
  GTEST_SKIP() << "not under AddressSanitizer";
#endif
  const int64_t d = 512;
  std::vector<float> k = randn(d, 1), v = randn(d, 2);
  mala::ForwardArgs a;
  a.q = fake(0x10000);
  a.o = fake(1ull << 52);
  a.k = k.data();
  a.v = v.data();
  a.seqlen_q = 0x7fffffff;
  a.seqlen_k = 1;
  a.heads_q = 256;
  a.head_dim = d;
  a.causal = false;
  ASSERT_TRUE(mala::check(a).ok) << mala::check(a).message;
  const mala::Status s = mala::forward(a);
  EXPECT_TRUE(starts_with(s, "out of memory:")) << s.message;
  EXPECT_NE(s.message.find(std::to_string(int64_t(0x7fffffff) * 256 * d * 4)), std::string::npos) << s.message;
}

// ---- D10: k_cache aliasing v_cache when appending ------------------------------------------------

TEST(BadInput, AppendingIntoAliasedCachesIsRefused) {
  const int64_t cap = 64, d = 16;
  std::vector<float> q = randn(d, 1), cache = randn(cap * d, 2), cache2 = randn(cap * d, 3);
  std::vector<float> kn = randn(d, 4), vn = randn(d, 5);
  std::vector<float> o(d, kSentinel), lse(1, kSentinel);
  const int32_t lens[] = {10};
  const std::vector<float> before = cache;
  mala::DecodeArgs a = small_decode(q, cache, cache, o, lse, lens, cap, d);
  a.k_new = kn.data();
  a.v_new = vn.data();
  a.seqlen_new = 1;
  const mala::Status s = mala::decode(a);
  EXPECT_TRUE(starts_with(s, "v_cache: overlaps k_cache")) << s.message;
  EXPECT_EQ(cache, before) << "the appended keys were written";
  EXPECT_TRUE(all_equal(o, kSentinel));
  // v_cache overlapping k_new (the append of v would overwrite the keys it copies).
  a.v_cache = cache2.data();
  a.k_new = cache2.data() + 20 * d;
  EXPECT_TRUE(starts_with(mala::check(a), "v_cache: overlaps k_new")) << mala::check(a).message;
  // Reading one cache as both k and v without appending is allowed (nothing is written).
  a = small_decode(q, cache, cache, o, lse, lens, cap, d);
  EXPECT_TRUE(mala::decode(a).ok);
}

}  // namespace

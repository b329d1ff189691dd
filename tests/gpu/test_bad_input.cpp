// Issue #64's input classes on CUDA (device pointers): the host-side checks that need no
// synchronization (num_splits, overflowing sizes, aliased caches when appending) refuse the call
// and write nothing, and a NaN input gives NaN, never a finite zero: a NaN query (decode, tau 0
// and 1, one and several splits; the forward at N = 1; the forward and backward of one NaN row in
// a sequence, every kernel), a NaN key and a NaN value (forward, decode), each against what the
// CPU implementation gives on the same inputs.  Varlen offsets on the device are the caller's
// contract (include/mala/mala.h, ForwardArgs::total_q): not tested here.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/backend.h"
#include "gpu_util.h"
#include "mala/mala.h"

using namespace mala_test;

namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

bool starts_with(const mala::Status& s, const std::string& prefix) {
  return !s.ok && s.message.rfind(prefix, 0) == 0;
}

constexpr int64_t kCap = 512, kD = 64;

struct DecodeBuffers {
  DeviceBuffer<uint16_t> q{kD}, kc{kCap * kD}, vc{kCap * kD}, kn{kD}, vn{kD}, o{kD};
  DeviceBuffer<float> lse{1};
  DeviceBuffer<int32_t> lens{1};
  // nan_key / nan_value: cache position (< 300, so every query sees it) whose key gets a NaN element
  // / whose value is all NaN; -1: none.
  explicit DecodeBuffers(bool nan_query, int nan_key = -1, int nan_value = -1) {
    std::vector<float> x = randn(kD, 1);
    if (nan_query) x[0] = NAN;
    q.upload(round_to(x, mala::DType::bf16));
    std::vector<float> k = randn(kCap * kD, 2), v = randn(kCap * kD, 3);
    if (nan_key >= 0) k[nan_key * kD + 7] = NAN;
    if (nan_value >= 0)
      for (int64_t x = 0; x < kD; ++x) v[nan_value * kD + x] = NAN;
    kc.upload(round_to(k, mala::DType::bf16));
    vc.upload(round_to(v, mala::DType::bf16));
    lens.upload({300});
    // Zeros, not the NaN poison: a NaN found afterwards was written by the call.
    cudaMemset(o.ptr, 0, kD * 2);
    cudaMemset(lse.ptr, 0, 4);
  }
  mala::DecodeArgs args() {
    mala::DecodeArgs a;
    a.device = mala::Device::cuda;
    a.dtype = mala::DType::bf16;
    a.q = q.ptr;
    a.k_cache = kc.ptr;
    a.v_cache = vc.ptr;
    a.cache_seqlens = lens.ptr;
    a.cache_capacity = kCap;
    a.head_dim = kD;
    a.o = o.ptr;
    a.lse = lse.ptr;
    return a;
  }
};

TEST(GpuBadInput, NumSplitsAboveTheBoundIsRefused) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DecodeBuffers b(false);
  mala::DecodeArgs a = b.args();
  for (int splits : {mala::kMaxNumSplits + 1, 0x7fffffff}) {
    a.num_splits = splits;
    EXPECT_TRUE(starts_with(mala::decode(a), "num_splits:")) << splits;
  }
  for (uint16_t x : b.o.download()) ASSERT_EQ(x, 0) << "o was written";
}

TEST(GpuBadInput, OverflowingSizesAreRefused) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DecodeBuffers b(false);
  mala::DecodeArgs a = b.args();
  a.v_cache_strides.batch = (int64_t(1) << 62) - 1;  // the element extent fits, the byte extent wraps
  a.batch = 2;
  const mala::Status s = mala::check(a);
  EXPECT_TRUE(starts_with(s, "v_cache:")) << s.message;
}

TEST(GpuBadInput, AppendingIntoAliasedCachesIsRefused) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DecodeBuffers b(false);
  const std::vector<uint16_t> before = b.kc.download();
  mala::DecodeArgs a = b.args();
  a.v_cache = b.kc.ptr;
  a.k_new = b.kn.ptr;
  a.v_new = b.vn.ptr;
  a.seqlen_new = 1;
  const mala::Status s = mala::decode(a);
  EXPECT_TRUE(starts_with(s, "v_cache: overlaps k_cache")) << s.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(b.kc.download(), before);
}

// Decodes b's query at tau with num_splits, expecting the call to succeed.
void run_decode(DecodeBuffers& b, float tau, int splits) {
  mala::DecodeArgs a = b.args();
  a.tau = tau;
  a.num_splits = splits;
  const mala::Status s = mala::decode(a);
  ASSERT_TRUE(s.ok) << s.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(GpuBadInput, NanQueryGivesNanInDecode) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (float tau : {0.f, 1.f})
    for (int splits : {1, 3, 0}) {
      DecodeBuffers b(true);
      ASSERT_NO_FATAL_FAILURE(run_decode(b, tau, splits));
      const std::vector<float> o = widen(b.o.download(), mala::DType::bf16);
      const std::vector<float> lse = b.lse.download();
      EXPECT_EQ(count_nan(o), o.size()) << "tau=" << tau << " splits=" << splits << ": o[0] = " << o[0];
      EXPECT_TRUE(std::isnan(lse[0])) << "tau=" << tau << " splits=" << splits << ": lse = " << lse[0];
    }
}

TEST(GpuBadInput, NanQueryGivesNanInForwardAtOneRow) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t nk = 300;
  for (float tau : {0.f, 1.f}) {
    std::vector<float> qf = randn(kD, 4), kf = randn(nk * kD, 5), vf = randn(nk * kD, 6);
    qf[0] = NAN;
    DeviceBuffer<uint16_t> q(kD), k(nk * kD), v(nk * kD), o(kD);
    DeviceBuffer<float> lse(1);
    cudaMemset(o.ptr, 0, kD * 2);
    cudaMemset(lse.ptr, 0, 4);
    q.upload(round_to(qf, mala::DType::bf16));
    k.upload(round_to(kf, mala::DType::bf16));
    v.upload(round_to(vf, mala::DType::bf16));
    mala::ForwardArgs a;
    a.device = mala::Device::cuda;
    a.dtype = mala::DType::bf16;
    a.q = q.ptr;
    a.k = k.ptr;
    a.v = v.ptr;
    a.o = o.ptr;
    a.lse = lse.ptr;
    a.seqlen_q = 1;
    a.seqlen_k = nk;
    a.head_dim = kD;
    a.tau = tau;
    const mala::Status s = mala::forward(a);
    ASSERT_TRUE(s.ok) << s.message;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> out = widen(o.download(), mala::DType::bf16);
    EXPECT_EQ(count_nan(out), out.size()) << "tau=" << tau << ": o[0] = " << out[0];
    EXPECT_TRUE(std::isnan(lse.download()[0])) << "tau=" << tau;
  }
}

// A NaN key or value in the cache: every query sees it.  A NaN key makes the scores of its tile
// NaN, which no skip test passes (the tile is retained at tau = 1 too): o and lse NaN.  A NaN value
// makes o NaN wherever its tile is retained: always at tau = 0 (lse finite); at tau = 1 the tile is
// the newest (position 299 of 300: the first tile visited, never skipped).
TEST(GpuBadInput, NanKeyOrValueGivesNanInDecode) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (bool key : {true, false})
    for (float tau : {0.f, 1.f})
      for (int splits : {1, 3, 0}) {
        DecodeBuffers b(false, key ? 40 : -1, key ? -1 : 299);
        ASSERT_NO_FATAL_FAILURE(run_decode(b, tau, splits));
        const std::vector<float> o = widen(b.o.download(), mala::DType::bf16);
        const float lse = b.lse.download()[0];
        const std::string what = std::string(key ? "NaN key" : "NaN value") + " tau=" + std::to_string(tau) +
                                 " splits=" + std::to_string(splits);
        EXPECT_EQ(count_nan(o), o.size()) << what << ": o[0] = " << o[0];
        if (key)
          EXPECT_TRUE(std::isnan(lse)) << what << ": lse = " << lse;
        else
          EXPECT_TRUE(std::isfinite(lse)) << what << ": lse = " << lse;
      }
}

// ---- one NaN in a sequence: the forward and the backward of every kernel against the CPU ----------

using mala::cuda_backend::BwdVariant;
using mala::cuda_backend::FwdVariant;

// One causal bf16 call of N = 384 queries and keys, 2 query heads on 1 KV head, with one NaN in
// the query row kRow of head 0, in key kKey, or in every element of value kKey (where = 0, 1, 2).
constexpr int64_t kN = 384, kHq = 2;
constexpr int64_t kRow = 150, kKey = 200;
enum Where { kNanQuery = 0, kNanKey = 1, kNanValue = 2 };
const char* where_name(int w) { return w == kNanQuery ? "NaN query" : w == kNanKey ? "NaN key" : "NaN value"; }

struct NanRun {
  // Host copies (fp32) of the bf16 inputs and the GPU's and the CPU's outputs; the CPU runs with the
  // GPU's tiles on the same rounded inputs (the backward on the GPU forward's o and lse).
  std::vector<float> q, k, v, dout;
  std::vector<float> o_g, lse_g, o_c, lse_c, dq_g, dk_g, dv_g, dq_c, dk_c, dv_c;
  std::vector<uint8_t> fmask_g, fmask_c, bmask_g, bmask_c;
  mala::Tiles ft, bt;
  int64_t fnq = 0, fnk = 0, bnq = 0, bnk = 0;  // tile counts
};

// Runs the forward (and, bwd, the backward) of the call with d dims and a NaN at `where`.
void run_nan_case(int where, int64_t d, float tau, bool bwd, bool deterministic, NanRun& r) {
  const mala::DType t = mala::DType::bf16;
  const int64_t nq = kN * kHq * d, nk = kN * d;
  r.q = randn(nq, 11);
  r.k = randn(nk, 12);
  r.v = randn(nk, 13);
  r.dout = randn(nq, 14);
  if (where == kNanQuery) r.q[(kRow * kHq + 0) * d + 3] = NAN;
  if (where == kNanKey) r.k[kKey * d + 3] = NAN;
  if (where == kNanValue)
    for (int64_t x = 0; x < d; ++x) r.v[kKey * d + x] = NAN;
  DeviceBuffer<uint16_t> q(nq), k(nk), v(nk), o(nq), dout(nq), dq(nq), dk(nk), dv(nk);
  DeviceBuffer<float> lse(kN * kHq);
  q.upload(round_to(r.q, t));
  k.upload(round_to(r.k, t));
  v.upload(round_to(r.v, t));
  dout.upload(round_to(r.dout, t));

  mala::ForwardArgs a;
  a.device = mala::Device::cuda;
  a.dtype = t;
  a.q = q.ptr, a.k = k.ptr, a.v = v.ptr, a.o = o.ptr, a.lse = lse.ptr;
  a.seqlen_q = a.seqlen_k = kN;
  a.heads_q = kHq, a.heads_kv = 1, a.head_dim = d;
  a.causal = true;
  a.tau = tau;
  r.ft = mala::forward_tiles(a);
  r.fnq = (kN + r.ft.block_q - 1) / r.ft.block_q, r.fnk = (kN + r.ft.block_k - 1) / r.ft.block_k;
  DeviceBuffer<uint8_t> fmask(kHq * r.fnq * r.fnk);
  a.tile_mask = fmask.ptr;
  mala::Status s = mala::forward(a);
  ASSERT_TRUE(s.ok) << s.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> o_bits = o.download();
  r.o_g = widen(o_bits, t);
  r.lse_g = lse.download();
  r.fmask_g = fmask.download();

  mala::ForwardArgs c = a;
  c.device = mala::Device::cpu;
  c.dtype = mala::DType::f32;
  r.o_c.assign(nq, 0.f), r.lse_c.assign(kN * kHq, 0.f), r.fmask_c.assign(fmask.count, 9);
  c.q = r.q.data(), c.k = r.k.data(), c.v = r.v.data(), c.o = r.o_c.data(), c.lse = r.lse_c.data();
  c.tile_mask = r.fmask_c.data();
  c.block_q = r.ft.block_q, c.block_k = r.ft.block_k;
  s = mala::forward(c);
  ASSERT_TRUE(s.ok) << s.message;
  if (!bwd) return;

  mala::BackwardArgs b;
  b.device = mala::Device::cuda;
  b.dtype = t;
  b.q = q.ptr, b.k = k.ptr, b.v = v.ptr, b.o = o.ptr, b.dout = dout.ptr, b.lse = lse.ptr;
  b.dq = dq.ptr, b.dk = dk.ptr, b.dv = dv.ptr;
  b.seqlen_q = b.seqlen_k = kN;
  b.heads_q = kHq, b.heads_kv = 1, b.head_dim = d;
  b.causal = true;
  b.tau = tau;
  b.deterministic = deterministic;
  r.bt = mala::backward_tiles(b);
  r.bnq = (kN + r.bt.block_q - 1) / r.bt.block_q, r.bnk = (kN + r.bt.block_k - 1) / r.bt.block_k;
  DeviceBuffer<uint8_t> bmask(kHq * r.bnq * r.bnk);
  b.tile_mask = bmask.ptr;
  s = mala::backward(b);
  ASSERT_TRUE(s.ok) << s.message;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.dq_g = widen(dq.download(), t);
  r.dk_g = widen(dk.download(), t);
  r.dv_g = widen(dv.download(), t);
  r.bmask_g = bmask.download();

  mala::BackwardArgs bc = b;
  bc.device = mala::Device::cpu;
  bc.dtype = mala::DType::f32;
  bc.deterministic = false;
  r.dq_c.assign(nq, 0.f), r.dk_c.assign(nk, 0.f), r.dv_c.assign(nk, 0.f), r.bmask_c.assign(bmask.count, 9);
  bc.q = r.q.data(), bc.k = r.k.data(), bc.v = r.v.data(), bc.o = r.o_g.data(), bc.dout = r.dout.data();
  bc.lse = r.lse_g.data();
  bc.dq = r.dq_c.data(), bc.dk = r.dk_c.data(), bc.dv = r.dv_c.data();
  bc.tile_mask = r.bmask_c.data();
  bc.block_q = r.bt.block_q, bc.block_k = r.bt.block_k;
  s = mala::backward(bc);
  ASSERT_TRUE(s.ok) << s.message;
}

// How many of row `row`'s n elements (rows of n floats) are NaN: all, none or some (-1).
int row_nan(const std::vector<float>& x, int64_t row, int64_t n) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += std::isnan(x[row * n + i]) ? 1 : 0;
  return c == n ? 1 : c == 0 ? 0 : -1;
}

class GpuNanKernels : public ::testing::TestWithParam<std::tuple<FwdVariant, BwdVariant>> {
 protected:
  void SetUp() override {
    mala::cuda_backend::KernelOverride o;
    o.fwd = std::get<0>(GetParam());
    o.bwd = std::get<1>(GetParam());
    mala::cuda_backend::set_kernel_override(o);
  }
  void TearDown() override { mala::cuda_backend::set_kernel_override({}); }
};

// Whether row `row`'s tiles (query tiles of bq rows) can share a key tile (of bk keys) with key
// `key` that it does not see: then a kernel's P V (a NaN value) or dS K (a NaN key) multiplies the
// row's P = 0 (or dS = 0) by NaN, which is NaN, where the CPU visits legal entries only.  Such rows
// are not checked (FlashAttention and torch's matmuls do the same).
bool shares_tile_unseen(int64_t row, int64_t key, int64_t bq, int64_t bk) {
  return row < key && (row / bq + 1) * bq > key / bk * bk;
}

// The forward of every input class: o and lse NaN exactly where the CPU has them (which the
// expectation of each class states too), and the decision tiles that hold a NaN score retained.
TEST_P(GpuNanKernels, ForwardPropagatesNanAsTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (int where : {kNanQuery, kNanKey, kNanValue})
    for (int64_t d : {64, 128, 256})
      for (float tau : {0.f, 1.f}) {
        NanRun r;
        run_nan_case(where, d, tau, false, false, r);
        if (HasFatalFailure()) return;
        const std::string what =
            std::string(where_name(where)) + " d=" + std::to_string(d) + " tau=" + std::to_string(tau);
        int64_t bad = 0;
        for (int64_t h = 0; h < kHq; ++h)
          for (int64_t row = 0; row < kN; ++row) {
            const int64_t lr = row * kHq + h, li = h * kN + row;  // o row, lse index
            // Expected, for the query: the NaN row alone; key: every row that sees key kKey; value:
            // o of those rows whose tile holding kKey was retained (at tau = 0 all), lse finite.
            const int64_t qt = row / r.ft.block_q, kt = kKey / r.ft.block_k;
            const bool sees = row >= kKey;
            const int og = row_nan(r.o_g, lr, d), oc = row_nan(r.o_c, lr, d);
            bool ok = true;
            if (where == kNanValue) {
              // The GPU is checked where the CPU's answer is the only one: a retained tile (a kernel
              // whose warpgroup runs P V for a pair that skipped it, with P = 0, or that shares a
              // tile with kKey without seeing it, also multiplies 0 by NaN; FlashAttention-like).
              const bool kept_g = r.fmask_g[(h * r.fnq + qt) * r.fnk + kt] == mala::kTileRetained;
              const bool kept_c = r.fmask_c[(h * r.fnq + qt) * r.fnk + kt] == mala::kTileRetained;
              if (sees && kept_g) ok &= og == 1;
              if (!sees && !shares_tile_unseen(row, kKey, r.ft.block_q, r.ft.block_k)) ok &= og == 0;
              ok &= oc == (sees && kept_c ? 1 : 0);
              ok &= std::isfinite(r.lse_g[li]) && std::isfinite(r.lse_c[li]);
              if (tau == 0.f) ok &= !sees || (kept_g && kept_c);
            } else {
              const bool nan = where == kNanQuery ? (row == kRow && h == 0) : sees;
              ok = og == (nan ? 1 : 0) && oc == (nan ? 1 : 0) && std::isnan(r.lse_g[li]) == nan &&
                   std::isnan(r.lse_c[li]) == nan;
            }
            if (!ok && bad++ < 5)
              ADD_FAILURE() << what << ": head " << h << " row " << row << ": o NaN gpu " << og << " cpu " << oc
                            << ", lse gpu " << r.lse_g[li] << " cpu " << r.lse_c[li];
          }
        EXPECT_EQ(bad, 0) << what;
        // A NaN score's decision tile is retained by both (at tau = 0 every legal tile is).
        const int64_t h0 = 0;
        if (where != kNanValue) {
          const int64_t qt0 = (where == kNanQuery ? kRow : kKey) / r.ft.block_q;
          const int64_t kt_end = where == kNanQuery ? kRow / r.ft.block_k + 1 : kKey / r.ft.block_k + 1;
          const int64_t kt_begin = where == kNanQuery ? 0 : kKey / r.ft.block_k;
          for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
            const size_t at = (h0 * r.fnq + qt0) * r.fnk + kt;
            EXPECT_EQ(r.fmask_g[at], mala::kTileRetained) << what << ": q tile " << qt0 << " k tile " << kt;
            EXPECT_EQ(r.fmask_c[at], mala::kTileRetained) << what << " (cpu): q tile " << qt0 << " k tile " << kt;
          }
        }
      }
}

// The backward of a NaN query row (and of a NaN key): that row's dq NaN (every row that sees the
// key), the other rows' dq finite; dk and dv NaN for every key the NaN row sees (a NaN key: every
// key), finite for keys outside every tile the row is computed with.  (Keys in between -- past the row's diagonal but inside a tile it shares with
// rows that see them -- are finite on the CPU, which visits only legal entries, and may be NaN in
// a kernel, whose masked entries have P = 2^(-inf - NaN) and dS = 0 (dP - NaN): as in
// FlashAttention, not checked.)  The decision tiles of the NaN row that hold its legal keys are
// retained (its lse is NaN: no skip test passes).
TEST_P(GpuNanKernels, BackwardPropagatesNanAsTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const bool det_ok = mala_test::device_is_sm90() && std::get<1>(GetParam()) == BwdVariant::automatic;
  for (int where : {kNanQuery, kNanKey})
    for (int64_t d : {64, 128, 256})
      for (float tau : {0.f, 1.f})
        for (bool det : {false, true}) {
          if (det && (!det_ok || d == 256)) continue;
          NanRun r;
          run_nan_case(where, d, tau, true, det, r);
          if (HasFatalFailure()) return;
          const std::string what = std::string(where_name(where)) + " d=" + std::to_string(d) +
                                   " tau=" + std::to_string(tau) + (det ? " deterministic" : "");
          int64_t bad = 0;
          auto check = [&](const char* name, int got, int cpu, int want, int64_t h, int64_t row) {
            if (want < 0 ? got == cpu : (got == want && cpu == want)) return;
            if (bad++ < 5)
              ADD_FAILURE() << what << ": " << name << " head " << h << " row " << row << ": NaN gpu " << got
                            << " cpu " << cpu << " expected " << want;
          };
          for (int64_t h = 0; h < kHq; ++h)
            for (int64_t row = 0; row < kN; ++row) {
              const bool nan_row = where == kNanQuery ? (row == kRow && h == 0) : row >= kKey;
              if (where == kNanKey && shares_tile_unseen(row, kKey, r.bt.block_q, r.bt.block_k)) continue;
              const int64_t lr = row * kHq + h;
              check("dq", row_nan(r.dq_g, lr, d), row_nan(r.dq_c, lr, d), nan_row ? 1 : 0, h, row);
            }
          // The last tile row the NaN row (query) shares: keys from there on are in no tile of it.
          const int64_t q_end = (kRow / r.bt.block_q + 1) * r.bt.block_q;
          const int64_t finite_from = (q_end + r.bt.block_k - 1) / r.bt.block_k * r.bt.block_k;
          for (int64_t key = 0; key < kN; ++key) {
            int want = 1;  // a NaN key: every key is seen by some row that sees it (the last row)
            if (where == kNanQuery) want = key <= kRow ? 1 : key >= finite_from ? 0 : -2;
            if (want == -2) continue;
            check("dk", row_nan(r.dk_g, key, d), row_nan(r.dk_c, key, d), want, 0, key);
            check("dv", row_nan(r.dv_g, key, d), row_nan(r.dv_c, key, d), want, 0, key);
          }
          EXPECT_EQ(bad, 0) << what;
          if (where == kNanQuery) {
            EXPECT_LT(finite_from, kN) << what;
            const int64_t qt = kRow / r.bt.block_q;
            for (int64_t kt = 0; kt * r.bt.block_k <= kRow; ++kt) {
              const size_t at = (0 * r.bnq + qt) * r.bnk + kt;
              EXPECT_EQ(r.bmask_g[at], mala::kTileRetained) << what << ": q tile " << qt << " k tile " << kt;
              EXPECT_EQ(r.bmask_c[at], mala::kTileRetained) << what << " (cpu): q tile " << qt << " k tile " << kt;
            }
          }
        }
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, GpuNanKernels,
    ::testing::Values(std::make_tuple(FwdVariant::automatic, BwdVariant::automatic),
                      std::make_tuple(FwdVariant::mma_sync, BwdVariant::mma_sync)),
    [](const ::testing::TestParamInfo<std::tuple<FwdVariant, BwdVariant>>& i) {
      return std::string(mala::cuda_backend::variant_name(std::get<0>(i.param))) + "_" +
             mala::cuda_backend::variant_name(std::get<1>(i.param));
    });

}  // namespace

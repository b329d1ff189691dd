// Issue #64's input classes on CUDA (device pointers): the host-side checks that need no
// synchronization (num_splits, overflowing sizes, aliased caches when appending) refuse the call
// and write nothing, and a NaN query gives NaN, never a finite zero (decode, tau 0 and 1, one
// and several splits; the forward at N = 1).  Varlen offsets on the device are the caller's
// contract (include/mala/mala.h, ForwardArgs::total_q): not tested here.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

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
  DecodeBuffers(bool nan_query) {
    std::vector<float> x = randn(kD, 1);
    if (nan_query) x[0] = NAN;
    q.upload(round_to(x, mala::DType::bf16));
    std::vector<float> k = randn(kCap * kD, 2), v = randn(kCap * kD, 3);
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

TEST(GpuBadInput, NanQueryGivesNanInDecode) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (float tau : {0.f, 1.f})
    for (int splits : {1, 3, 0}) {
      DecodeBuffers b(true);
      mala::DecodeArgs a = b.args();
      a.tau = tau;
      a.num_splits = splits;
      const mala::Status s = mala::decode(a);
      ASSERT_TRUE(s.ok) << s.message;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
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

}  // namespace

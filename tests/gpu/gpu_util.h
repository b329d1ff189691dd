// Helpers shared by the GPU tests: device buffers, bf16/fp16 conversion on the host, poisoning,
// comparisons.  The GPU tests compare every kernel with the CPU implementation (src/cpu) run on the
// same rounded inputs converted to fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <random>
#include <utility>
#include <vector>

#include "mala/mala.h"

#define MALA_CUDA_CHECK(expr)                                                              \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);             \
  } while (0)

namespace mala_test {

// Round fp32 to the storage type and back (what the GPU sees), as raw 16-bit words.
inline uint16_t to_bits(float x, mala::DType t) {
  if (t == mala::DType::bf16) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  __half h = __float2half_rn(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float from_bits(uint16_t b, mala::DType t) {
  if (t == mala::DType::bf16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &b, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}

// Rounds x in place to the storage precision and returns the 16-bit words.
inline std::vector<uint16_t> round_to(std::vector<float>& x, mala::DType t) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    bits[i] = to_bits(x[i], t);
    x[i] = from_bits(bits[i], t);
  }
  return bits;
}
inline std::vector<float> widen(const std::vector<uint16_t>& bits, mala::DType t) {
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = from_bits(bits[i], t);
  return x;
}

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

// A device buffer that is poisoned (0xFF bytes: NaN for floats, -1 for ints) when allocated, so
// unwritten outputs are caught.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n = 0) { resize(n); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
  void resize(size_t n) {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    count = n;
    if (n) {
      if (cudaMalloc(&ptr, n * sizeof(T)) != cudaSuccess) { ptr = nullptr; count = 0; return; }
      poison();
    }
  }
  // Complete before returning: cudaMemset runs on the legacy stream, which a test's non-blocking
  // stream does not wait for, so an asynchronous poison could land after the kernel's writes.
  void poison() {
    if (!ptr) return;
    cudaMemset(ptr, 0xFF, count * sizeof(T));
    cudaStreamSynchronize(0);
  }
  void upload(const std::vector<T>& h) { cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> download() const {
    std::vector<T> h(count);
    cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

// 16-bit words that are still the poison pattern (0xFFFF is a NaN in both bf16 and fp16).
// Whether the current device is sm_90 (the Hopper-only paths).
inline bool device_is_sm90() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return false;
  return major == 9;
}

inline size_t count_poison(const std::vector<uint16_t>& bits) {
  size_t n = 0;
  for (uint16_t b : bits) n += (b == 0xFFFF);
  return n;
}
inline size_t count_nan(const std::vector<float>& x) {
  size_t n = 0;
  for (float v : x) n += std::isnan(v);
  return n;
}

inline double rel_l2(const std::vector<float>& x, const std::vector<float>& ref) {
  return mala::relative_l2(x.data(), ref.data(), static_cast<int64_t>(x.size()));
}

// ---- fuzzing (the *Fuzz.RandomShapes tests) ------------------------------------------------------
// Each op's fuzz test draws its cases from one std::mt19937_64 with a fixed seed, so a run is
// reproducible (on any platform: only the engine's raw output is used, never a std distribution).
// Environment: MALA_FUZZ_SEED (base seed, default 35), MALA_FUZZ_CASES (cases per fuzz test instead
// of the test's default), MALA_FUZZ_CASE (run only that case index; the earlier ones are still drawn).
struct FuzzConfig {
  uint64_t seed = 35;
  int cases = 0;
  int only = -1;
};
inline FuzzConfig fuzz_config(int default_cases) {
  FuzzConfig f;
  f.cases = default_cases;
  if (const char* s = std::getenv("MALA_FUZZ_SEED")) f.seed = std::strtoull(s, nullptr, 0);
  if (const char* s = std::getenv("MALA_FUZZ_CASES")) f.cases = std::atoi(s);
  if (const char* s = std::getenv("MALA_FUZZ_CASE")) f.only = std::atoi(s);
  return f;
}

struct Fuzz {
  std::mt19937_64 rng;
  explicit Fuzz(uint64_t seed) : rng(seed) {}
  uint64_t next() { return rng(); }
  // Uniform in [lo, hi] (modulo bias negligible at these ranges).
  int uniform(int lo, int hi) { return lo + static_cast<int>(rng() % static_cast<uint64_t>(hi - lo + 1)); }
  bool chance(double p) { return static_cast<double>(rng() >> 11) * 0x1.0p-53 < p; }
  template <typename T>
  T pick(std::initializer_list<T> v) { return *(v.begin() + uniform(0, static_cast<int>(v.size()) - 1)); }
  // A sequence length in [1, max]: often small, often next to a multiple of 64 (tile edges), else uniform.
  int length(int max) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    if (u < 0.25) return uniform(1, std::min(max, 80));
    if (u < 0.45 && max >= 63) {
      const int tiles = uniform(1, std::max(1, max / 64));  // two statements: a fixed draw order
      return std::min(max, 64 * tiles + uniform(-1, 1));
    }
    return uniform(1, max);
  }
  // (heads_q, heads_kv), heads_q % heads_kv == 0: MHA, GQA and MQA up to 8 query heads.
  std::pair<int, int> heads() {
    static const int kHeads[][2] = {{1, 1}, {2, 2}, {3, 3}, {4, 4}, {8, 8}, {4, 2}, {6, 2},
                                    {6, 3}, {8, 2}, {8, 4}, {2, 1}, {3, 1}, {4, 1}, {8, 1}};
    const int i = uniform(0, static_cast<int>(sizeof(kHeads) / sizeof(kHeads[0])) - 1);
    return {kHeads[i][0], kHeads[i][1]};
  }
};

// What a fuzz test reports in its summary line.
struct FuzzStats {
  int64_t cases = 0, tiles = 0, flips = 0, failed = 0;
  double max_err = 0;
};

// Test-part results (failures) recorded so far in the running test: a case failed when this grew.
inline int fuzz_failures_so_far() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
}

// The fuzz loop: draw(fuzz, index) makes case `index` (every case is drawn, run or not, so that an
// index names the same case under MALA_FUZZ_CASE), run(case, &stats) checks it against the CPU.
// Stops after 10 failed cases; prints the seed and count first and one summary line last.
template <typename Draw, typename Run>
FuzzStats run_fuzz(const char* tag, int default_cases, uint64_t stream, Draw draw, Run run) {
  const FuzzConfig cfg = fuzz_config(default_cases);
  Fuzz fz(cfg.seed * 0x9E3779B97F4A7C15ull + stream);
  std::printf("[%s] seed %llu (MALA_FUZZ_SEED), %d cases (MALA_FUZZ_CASES)", tag,
              static_cast<unsigned long long>(cfg.seed), cfg.cases);
  if (cfg.only >= 0) std::printf(", only case %d (MALA_FUZZ_CASE)", cfg.only);
  std::printf("\n");
  std::fflush(stdout);
  FuzzStats st;
  for (int i = 0; i < cfg.cases; ++i) {
    const auto c = draw(fz, i);
    if (cfg.only >= 0 && i != cfg.only) continue;
    const int before = fuzz_failures_so_far();
    {
      SCOPED_TRACE(::testing::Message() << tag << " case " << i << " (rerun alone: MALA_FUZZ_SEED=" << cfg.seed
                                        << " MALA_FUZZ_CASE=" << i << ")");
      run(c, &st);
    }
    if (fuzz_failures_so_far() != before) {
      ++st.failed;
      if (st.failed >= 10) {
        ADD_FAILURE() << tag << ": stopped after " << st.failed << " failed cases";
        break;
      }
    }
  }
  std::printf("[%s] %lld cases checked, %lld failed; %lld legal tiles compared, %lld flips; max rel L2 %.2e\n", tag,
              static_cast<long long>(st.cases), static_cast<long long>(st.failed), static_cast<long long>(st.tiles),
              static_cast<long long>(st.flips), st.max_err);
  return st;
}

}  // namespace mala_test

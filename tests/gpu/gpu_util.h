// Helpers shared by the GPU tests: device buffers, bf16/fp16 conversion on the host, poisoning,
// comparisons.  The GPU tests compare every kernel with the CPU implementation (src/cpu) run on the
// same rounded inputs converted to fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
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
  void poison() { if (ptr) cudaMemset(ptr, 0xFF, count * sizeof(T)); }
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

}  // namespace mala_test

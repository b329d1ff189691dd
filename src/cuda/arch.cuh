// Which kernel family a launch may use on the current device.
#pragma once

#include <cuda_runtime.h>
#include <stdlib.h>

namespace mala {
namespace cuda {

// False when the environment variable `name` is "0" (a switch for tests and benchmarks), else true.
// (Callers keep the answer in a static: it is read once per process.)
inline bool env_switch_on(const char* name) {
  const char* e = getenv(name);
  return !(e != nullptr && e[0] == '0');
}

// True when the current device is sm_90, `kernel` (a wgmma kernel) was compiled for sm_90a -- a
// build for other architectures only would run the kernel's empty pre-Hopper body (PTX JIT from an
// older target) -- and the environment variable `env_switch` is not "0" (the switch lets the tests
// and benchmarks run the mma.sync kernels on the same device).
inline bool wgmma_kernel_usable(const void* kernel, const char* env_switch) {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9 || !env_switch_on(env_switch)) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
}

}  // namespace cuda
}  // namespace mala

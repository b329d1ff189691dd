// Which kernel family a launch may use on the current device.
#pragma once

#include <cuda_runtime.h>
#include <stdlib.h>

namespace mala {
namespace cuda {

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
  const char* e = getenv(env_switch);
  if (major != 9 || (e != nullptr && e[0] == '0')) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
}

// False when the environment variable `name` is "0" (a switch for tests and benchmarks), else true;
// read once per process.
inline bool env_switch_on(const char* name) {
  const char* e = getenv(name);
  return !(e != nullptr && e[0] == '0');
}

}  // namespace cuda
}  // namespace mala

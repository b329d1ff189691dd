// Which kernel family a launch may use on the current device (host side).
#pragma once

#include <cuda_runtime.h>

namespace mala {
namespace cuda {

// True when the current device is sm_90 and `kernel` (a wgmma kernel) was compiled for sm_90a.  A
// build for other architectures only would run the kernel's empty pre-Hopper body (PTX JIT from an
// older target), so both must hold before a dispatch picks a wgmma kernel.
inline bool wgmma_kernel_usable(const void* kernel) {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major != 9) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.ptxVersion >= 90 && attr.binaryVersion >= 90;
}

}  // namespace cuda
}  // namespace mala

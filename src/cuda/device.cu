// Device queries shared by the CUDA entry points.
#include <cuda_runtime.h>

#include "cuda/backend.h"

namespace mala {
namespace cuda_backend {

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
}

std::string device_name() {
  int dev = 0;
  cudaDeviceProp prop;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    cudaGetLastError();
    return "no CUDA device";
  }
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
}

Status check_device_pointer(const void* p, const char* what) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    // Without a usable device every pointer query fails: say that, not that the pointer is wrong.
    // (Asked only on failure, so a valid call pays for one query per pointer, as before.)
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      cudaGetLastError();  // clear the sticky error
      return Status::error(std::string("device: no CUDA device is available (cudaGetDeviceCount: ") +
                           (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")");
    }
    return Status::error(std::string(what) + ": not a CUDA device pointer");
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return Status::error(std::string(what) + ": expected CUDA device memory, got host memory");
  return Status::success();
}

}  // namespace cuda_backend
}  // namespace mala

// The backward's main-kernel launchers for one (dtype, head dim), included by
// instantiations/bwd_*.cu: the kernel BwdLaunch names, with no choice of its own (dispatch.cu makes
// every choice).
#pragma once

#include "cuda/bwd/kernel_sm80.cuh"
#include "cuda/bwd/sm90_kernel.cuh"
#include "cuda/bwd/sm90_256_kernel.cuh"
#include "cuda/bwd/launch.h"
#include "cuda/core/arch.cuh"

namespace mala {
namespace cuda {

// The warp-specialized kernels exist at d = 64 and 128 (sm90_kernel.cuh) and 256
// (sm90_256_kernel.cuh).
template <int D>
constexpr bool bwd_has_wgmma() { return D == 64 || D == 128; }

// Whether this build's wgmma kernels run on the current device (false for head dims without them).
// Probes the warp-specialized kernel itself, the one a true answer lets run.
template <typename T, int D>
bool bwd_wgmma_usable() {
  if constexpr (bwd_has_wgmma<D>()) {
    static const bool ok =
        wgmma_kernel_usable(reinterpret_cast<const void*>(bwd_main_kernel_sm90_ws<T, D, true, false, false>));
    return ok;
  } else if constexpr (D == 256) {
    static const bool ok = wgmma_kernel_usable(reinterpret_cast<const void*>(bwd_main_kernel_sm90_ws256<T, true>));
    return ok;
  } else {
    return false;
  }
}

template <typename T, int D>
cudaError_t launch_bwd_main(const BwdParams& p, const BwdLaunch& l, cudaStream_t stream) {
  if constexpr (D == 256) {
    if (l.kernel == BwdKernelKind::sm90_ws) return launch_bwd_sm90_ws256<T>(p, *l.maps, l.dense, stream);
  }
  if constexpr (bwd_has_wgmma<D>()) {
    if (l.kernel == BwdKernelKind::sm90_ws)
      return launch_bwd_sm90_ws<T, D>(p, *l.maps, l.dense, l.fwd_mask, l.dq_fixed, stream);
  }
  return launch_bwd_sm80<T, D>(p, l.dense, stream);
}

}  // namespace cuda
}  // namespace mala

#define MALA_INSTANTIATE_BWD(T, D)                                                                      \
  template cudaError_t mala::cuda::launch_bwd_main<T, D>(const mala::cuda::BwdParams&,                  \
                                                         const mala::cuda::BwdLaunch&, cudaStream_t);   \
  template bool mala::cuda::bwd_wgmma_usable<T, D>();

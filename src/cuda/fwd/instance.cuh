// The forward's launchers for one (dtype, head dim), included by instantiations/fwd_*.cu: the
// kernel FwdLaunch names, with no choice of its own (dispatch.cu makes every choice).
#pragma once

#include "cuda/core/arch.cuh"
#include "cuda/fwd/kernel_sm80.cuh"
#include "cuda/fwd/sm90_kernel.cuh"
#include "cuda/fwd/launch.h"

namespace mala {
namespace cuda {

// Whether this build's wgmma kernel runs on the current device (false for head dims without it:
// fwd_has_sm90_k128, tiles.h).  Probes the 128-key kernel itself, the one a true answer lets run.
template <typename T, int D>
bool fwd_wgmma_usable() {
  if constexpr (fwd_has_sm90_k128(D)) {
    static const bool ok =
        wgmma_kernel_usable(reinterpret_cast<const void*>(mala_fwd_kernel_sm90_k128<T, D, false, false, false>));
    return ok;
  } else {
    return false;
  }
}

template <typename T, int D>
cudaError_t launch_fwd(const FwdParams& p, const FwdLaunch& l, cudaStream_t stream) {
  if constexpr (fwd_has_sm90_k128(D)) {
    if (l.kernel == FwdKernelKind::sm90_k128)
      return launch_fwd_sm90_k128<T, D>(p, l.dense, l.seeded, l.record, l.tmap_k, l.tmap_v, stream);
  }
  return launch_fwd_sm80<T, D>(p, l.dense, l.seeded, stream);
}

}  // namespace cuda
}  // namespace mala

#define MALA_INSTANTIATE_FWD(T, D)                                                                   \
  template cudaError_t mala::cuda::launch_fwd<T, D>(const mala::cuda::FwdParams&, const mala::cuda::FwdLaunch&, \
                                                    cudaStream_t);                                   \
  template bool mala::cuda::fwd_wgmma_usable<T, D>();

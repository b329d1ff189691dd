// The backward main kernels as dispatch.cu sees them: which kernel and instance to run, and the
// launchers that instantiations/bwd_*.cu define (bwd/instance.cuh).  Host code only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda/bwd/params.cuh"  // and tiles.h: BwdKernelKind, the tile table

namespace mala {
namespace cuda {

struct BwdLaunch {
  BwdKernelKind kernel = BwdKernelKind::sm80;
  bool dense = false;               // tau = 0: the kernel's dense instance
  const BwdTmaMaps* maps = nullptr;  // sm90_ws
  // sm90_ws at d = 64 / 128: the instances that read forward_tile_mask (BwdParams::fwd_mask set) and
  // that add dQ in fixed point (deterministic mode, BwdParams::dq_fixed set).
  bool fwd_mask = false;
  bool dq_fixed = false;
};

// Launches the main kernel l names; every choice is the caller's (dispatch.cu).
template <typename T, int D>
cudaError_t launch_bwd_main(const BwdParams& p, const BwdLaunch& l, cudaStream_t stream);
// Whether the wgmma kernel of this instantiation can run on the current device (false for head dims
// without it).
template <typename T, int D>
bool bwd_wgmma_usable();

}  // namespace cuda
}  // namespace mala

// The forward's kernels as dispatch.cu sees them: which kernel and instance to run, and the
// launchers that instantiations/fwd_*.cu define (fwd/instance.cuh).  Host code only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "cuda/fwd/params.h"  // and tiles.h: FwdKernelKind, the tile table

namespace mala {
namespace cuda {

struct FwdLaunch {
  FwdKernelKind kernel = FwdKernelKind::sm80;
  // The instance's flags, in the kernels' order (kDense, kSeeded, kRecord: fwd/sm90_kernel.cuh).
  bool dense = false;   // tau = 0: the kernel's dense instance (sm80: where FwdConfig has one)
  // A seeded split (FwdParams::seed_lse, tau > 0): the sm90_k128 and sm80 instances with the seed's
  // bookkeeping (its code in the loop slowed the unseeded instances when they shared it).
  bool seeded = false;
  // The instance with the recording code: sm90_k128 where the call asks for the tile mask or the
  // slots (sm80 has no instance without it).
  bool record = false;
  CUtensorMap tmap_k{}, tmap_v{};  // sm90_k128: K and V described to the TMA (core/tma.cuh)
};

// Launches the kernel l names; every choice is the caller's (dispatch.cu).
template <typename T, int D>
cudaError_t launch_fwd(const FwdParams& p, const FwdLaunch& l, cudaStream_t stream);
// Whether the wgmma kernels of this instantiation can run on the current device (false for head
// dims without them).
template <typename T, int D>
bool fwd_wgmma_usable();

}  // namespace cuda
}  // namespace mala

// The decode kernels as dispatch.cu sees them: which split-kernel instance to run, and the launcher
// that instantiations/decode_*.cu define (decode/instance.cuh).  Host code only.
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/params.h"

namespace mala {
namespace cuda {

// Devices (by index) whose per-device facts the host side caches; calls on devices past this
// query every time.
constexpr int kMaxCachedDevices = 64;

struct DecodeLaunch {
  bool dense = false;       // tau = 0: V streamed with K; otherwise V is read only for retained tiles
  bool large_smem = false;  // the instance sized for sm_90's 227 KB of shared memory per block (else 163 KB)
  bool pdl = false;         // programmatic dependent launch of the split and combine kernels (sm_90+)
  int device = 0;           // the current device
};

// Enqueues the append (seqlen_new > 0), split and combine (num_splits > 1) kernels.
template <typename T, int D>
cudaError_t launch_decode(const DecodeParams& p, const DecodeLaunch& l, cudaStream_t stream);

}  // namespace cuda
}  // namespace mala

// Launchers of the decode kernels, one per (dtype, head_dim), defined in
// src/cuda/instantiations/decode_*.cu and dispatched from src/cuda/decode.cu.
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode_params.cuh"

namespace mala {
namespace cuda {

// Enqueues the append (seqlen_new > 0), split and combine (S > 1) kernels.  dense: tau == 0 variant
// (V streamed with K); otherwise V is read only for retained tiles.
#define MALA_DECODE_LAUNCHER(NAME) cudaError_t NAME(const DecodeParams& p, bool dense, cudaStream_t stream)
MALA_DECODE_LAUNCHER(launch_decode_bf16_d64);
MALA_DECODE_LAUNCHER(launch_decode_bf16_d128);
MALA_DECODE_LAUNCHER(launch_decode_bf16_d256);
MALA_DECODE_LAUNCHER(launch_decode_fp16_d64);
MALA_DECODE_LAUNCHER(launch_decode_fp16_d128);
MALA_DECODE_LAUNCHER(launch_decode_fp16_d256);

}  // namespace cuda
}  // namespace mala

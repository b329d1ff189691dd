// Decode kernels for bf16, head_dim 128 (see src/cuda/decode_kernel.cuh).
#include "cuda/decode_kernel.cuh"
#include "cuda/decode_launch.cuh"

namespace mala {
namespace cuda {
MALA_DECODE_LAUNCHER(launch_decode_bf16_d128) { return launch_decode_impl<__nv_bfloat16, 128>(p, dense, stream); }
}  // namespace cuda
}  // namespace mala

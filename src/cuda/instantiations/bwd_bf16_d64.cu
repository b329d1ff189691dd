// Fused MALA backward, bf16, head dim 64 (see src/cuda/bwd_kernel.cuh).
#include "cuda/bwd_kernel.cuh"
MALA_INSTANTIATE_BWD(__nv_bfloat16, 64)

// Fused MALA backward, fp16, head dim 128 (src/cuda/bwd_kernel.cuh; on sm_90, bwd_kernel_sm90.cuh).
#include "cuda/bwd_kernel_sm90.cuh"
MALA_INSTANTIATE_BWD(__half, 128)

// Fused MALA backward, fp16, head dim 128 (see src/cuda/bwd_kernel.cuh).
#include "cuda/bwd_kernel.cuh"
MALA_INSTANTIATE_BWD(__half, 128)

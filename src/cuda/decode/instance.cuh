// The decode's launchers for one (dtype, head dim), included by instantiations/decode_*.cu: the
// append (seqlen_new > 0), split and combine (num_splits > 1) kernels, with the split kernel's
// instance DecodeLaunch names and no choice of its own (dispatch.cu makes every choice).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "cuda/decode/kernel.cuh"
#include "cuda/decode/combine.cuh"
#include "cuda/decode/append.cuh"
#include "cuda/decode/launch.h"

namespace mala {
namespace cuda {

// A decode kernel launched as a programmatic dependent of the stream's previous work when `pdl`
// (sm_90+): it may be scheduled before that work completes and waits for it (griddepcontrol.wait).
inline cudaError_t launch_decode_kernel(void (*kernel)(DecodeParams), dim3 grid, int threads, size_t smem, bool pdl,
                                        const DecodeParams& p, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// The devices on which one kernel's dynamic shared memory limit has been raised.  The attribute
// belongs to the device's copy of the kernel (cudaFuncSetAttribute acts on the current device), so
// it is set once per device, on the device's first launch, not once per process nor per call.  That
// first launch may be under stream capture, where cudaFuncSetAttribute is allowed.  A failed call is
// not remembered: the next launch tries again.
class SmemOptIn {
 public:
  cudaError_t ensure(void (*kernel)(DecodeParams), int smem, int device) {
    const bool cacheable = device >= 0 && device < kMaxCachedDevices;
    if (cacheable && done_[device].load(std::memory_order_acquire)) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err == cudaSuccess && cacheable) done_[device].store(true, std::memory_order_release);
    return err;
  }

 private:
  std::atomic<bool> done_[kMaxCachedDevices] = {};
};

template <typename T, int D, bool kDense, bool kLargeSmem>
cudaError_t launch_split_kernel(const DecodeParams& p, const DecodeLaunch& l, cudaStream_t stream) {
  constexpr int smem = DecodeConfig<D, kLargeSmem>::smem_bytes(kDense);
  static SmemOptIn opted_in;  // one per kernel instance
  const cudaError_t err = opted_in.ensure(decode_split_kernel<T, D, kDense, kLargeSmem>, smem, l.device);
  if (err != cudaSuccess) return err;
  return launch_decode_kernel(decode_split_kernel<T, D, kDense, kLargeSmem>, dim3(p.NQT * p.S, p.HS, p.B),
                              DecodeConfig<D, kLargeSmem>::THREADS, smem, l.pdl, p, stream);
}

template <typename T, int D>
cudaError_t launch_decode(const DecodeParams& p, const DecodeLaunch& l, cudaStream_t stream) {
  if (p.seqlen_new > 0) {
    decode_append_kernel<T, D><<<dim3(p.seqlen_new * p.Hkv, p.B), 2 * (D / 8), 0, stream>>>(p);
  }
  const bool pdl = l.pdl;
  cudaError_t err = l.dense ? (l.large_smem ? launch_split_kernel<T, D, true, true>(p, l, stream)
                                            : launch_split_kernel<T, D, true, false>(p, l, stream))
                            : (l.large_smem ? launch_split_kernel<T, D, false, true>(p, l, stream)
                                            : launch_split_kernel<T, D, false, false>(p, l, stream));
  if (err != cudaSuccess) return err;
  if (p.S > 1) {
    err = launch_decode_kernel(decode_combine_kernel<T, D>, dim3(static_cast<unsigned>(merge_items<D>(p))),
                               kMergeThreads, merge_smem_bytes(), pdl, p, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

#define MALA_INSTANTIATE_DECODE(T, D)                                                                    \
  template cudaError_t mala::cuda::launch_decode<T, D>(const mala::cuda::DecodeParams&,                  \
                                                       const mala::cuda::DecodeLaunch&, cudaStream_t);

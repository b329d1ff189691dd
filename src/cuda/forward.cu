// CUDA forward entry point: resolves the arguments into FwdParams and dispatches on dtype x head
// dim to the instantiations in instantiations/fwd_*.cu (kernel in fwd_kernel.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "cpu/layout.h"
#include "cuda/backend.h"
#include "cuda/fwd_params.h"

namespace mala {
namespace cuda {
// Defined in instantiations/fwd_<dtype>_d<D>.cu.
template <typename T, int D> cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream);
}  // namespace cuda

namespace cuda_backend {

namespace {
bool supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

Tiles native_tiles(int64_t d) {
  switch (d) {
    case 64: return {16 * cuda::FwdConfig<64>::kMT, cuda::FwdConfig<64>::kBk};
    case 256: return {16 * cuda::FwdConfig<256>::kMT, cuda::FwdConfig<256>::kBk};
    default: return {16 * cuda::FwdConfig<128>::kMT, cuda::FwdConfig<128>::kBk};
  }
}
}  // namespace

Tiles forward_tiles(const ForwardArgs& a) { return native_tiles(a.head_dim); }

Status forward(const ForwardArgs& a) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16)
    return Status::error(std::string("dtype: the CUDA forward supports bfloat16 and float16 (got ") +
                         dtype_name(a.dtype) + ")");
  if (!supported_head_dim(a.head_dim))
    return Status::error("head_dim: the CUDA forward supports 64, 128 and 256 (got " + std::to_string(a.head_dim) +
                         ")");
  const Tiles t = native_tiles(a.head_dim);
  if ((a.block_q != 0 && a.block_q != t.block_q) || (a.block_k != 0 && a.block_k != t.block_k))
    return Status::error("block_q/block_k: the CUDA forward for head_dim " + std::to_string(a.head_dim) +
                         " uses " + std::to_string(t.block_q) + "x" + std::to_string(t.block_k) + " (got " +
                         std::to_string(a.block_q) + "x" + std::to_string(a.block_k) + "); pass 0");
  if (a.heads_kv <= 0 || a.heads_q % a.heads_kv != 0)
    return Status::error("heads_kv: must divide heads_q");
  if (a.seqlen_q > INT32_MAX / 2 || a.seqlen_k > INT32_MAX / 2 || a.batch > 65535 || a.heads_q > 65535)
    return Status::error("seqlen_q/seqlen_k/batch/heads_q: too large for the CUDA forward");

  const int64_t d = a.head_dim;
  const layout::Resolved qs = layout::resolve(a.q_strides, a.seqlen_q, a.heads_q, d);
  const layout::Resolved ks = layout::resolve(a.k_strides, a.seqlen_k, a.heads_kv, d);
  const layout::Resolved vs = layout::resolve(a.v_strides, a.seqlen_k, a.heads_kv, d);
  const layout::Resolved os = layout::resolve(a.o_strides, a.seqlen_q, a.heads_q, d);
  // cp.async moves 16-byte chunks and O is stored 4 bytes at a time: rows must stay aligned.
  for (int64_t s : {qs.batch, qs.row, qs.head, ks.batch, ks.row, ks.head, vs.batch, vs.row, vs.head})
    if (s % 8 != 0) return Status::error("q/k/v strides: the CUDA forward needs strides that are multiples of 8 elements");
  for (int64_t s : {os.batch, os.row, os.head})
    if (s % 2 != 0) return Status::error("o_strides: the CUDA forward needs even strides");
  for (const void* ptr : {a.q, a.k, a.v})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return Status::error("q/k/v: must be 16-byte aligned for the CUDA forward");
  if (reinterpret_cast<uintptr_t>(a.o) % 4 != 0) return Status::error("o: must be 4-byte aligned");

  cuda::FwdParams p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.o = a.o;
  p.lse = a.lse;
  p.slots = a.fwd_slots;
  p.tile_mask = a.tile_mask;
  p.q_sb = qs.batch, p.q_sr = qs.row, p.q_sh = qs.head;
  p.k_sb = ks.batch, p.k_sr = ks.row, p.k_sh = ks.head;
  p.v_sb = vs.batch, p.v_sr = vs.row, p.v_sh = vs.head;
  p.o_sb = os.batch, p.o_sr = os.row, p.o_sh = os.head;
  p.cu_q = a.cu_seqlens_q;
  p.cu_k = a.cu_seqlens_k;
  p.total_k = static_cast<int>(a.total_k);
  p.batch = static_cast<int>(a.batch);
  p.seqlen_q = static_cast<int>(a.seqlen_q);
  p.seqlen_k = static_cast<int>(a.seqlen_k);
  p.heads_q = static_cast<int>(a.heads_q);
  p.heads_kv = static_cast<int>(a.heads_kv);
  p.group = static_cast<int>(a.heads_q / a.heads_kv);
  p.n_q_tiles_mask = static_cast<int>((a.seqlen_q + t.block_q - 1) / t.block_q);
  p.n_k_tiles_mask = static_cast<int>((a.seqlen_k + t.block_k - 1) / t.block_k);
  p.causal = a.causal;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.log2_tau = a.tau > 0.f ? std::log2(a.tau) : -INFINITY;

  if (a.batch == 0 || a.seqlen_q == 0) return Status::success();
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  cudaError_t err = cudaSuccess;
  const bool bf16 = a.dtype == DType::bf16;
  switch (d) {
    case 64: err = bf16 ? cuda::launch_fwd<__nv_bfloat16, 64>(p, stream) : cuda::launch_fwd<__half, 64>(p, stream); break;
    case 128: err = bf16 ? cuda::launch_fwd<__nv_bfloat16, 128>(p, stream) : cuda::launch_fwd<__half, 128>(p, stream); break;
    case 256: err = bf16 ? cuda::launch_fwd<__nv_bfloat16, 256>(p, stream) : cuda::launch_fwd<__half, 256>(p, stream); break;
  }
  if (err != cudaSuccess)
    return Status::error(std::string("device: CUDA forward launch failed: ") + cudaGetErrorString(err));
  return Status::success();
}

}  // namespace cuda_backend
}  // namespace mala

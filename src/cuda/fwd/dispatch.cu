// The CUDA forward's host side: checks what the kernels need, resolves the arguments into FwdParams,
// and chooses the kernel -- the only place where that happens:
//   sm_90 (sm_90a build), every head dim: the 128-key kernel where the TMA can describe K and V
//     (fwd/sm90_kernel.cuh, every tau; 64-key tiles at d = 256);
//   everything else, and on sm_90 what the TMA cannot describe (varlen calls without total_k, a
//     stride or address the tensor map refuses): the mma.sync kernel (fwd/kernel_sm80.cuh).
// The decision tile is the chosen kernel's row of the tile table, fwd/tiles.h (forward_tiles asks the
// same choice).  Each kernel's tau = 0 instance runs at tau = 0 (the mma.sync kernel's where FwdConfig
// has one).  The kernel override (backend.h) forces the mma.sync kernel for tests and benchmarks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <string>

#include "common/layout.h"
#include "common/rule.h"
#include "cuda/backend.h"
#include "cuda/core/tma.cuh"
#include "cuda/fwd/launch.h"

namespace mala {

namespace cuda_backend {

namespace {

// The kernel for this call (see the top of the file).
template <typename T, int D>
cuda::FwdLaunch choose_kernel(const cuda::FwdParams& p, bool dense) {
  const FwdVariant forced = kernel_override().fwd;
  cuda::FwdLaunch l;
  l.kernel = cuda::FwdKernelKind::sm80;
  l.dense = dense && cuda::FwdConfig<D>::kDenseInstance;
  l.seeded = p.seed_lse != nullptr && !dense;
  l.record = p.tile_mask != nullptr;
  if (forced == FwdVariant::mma_sync || !cuda::fwd_wgmma_usable<T, D>()) return l;
  // K and V by TMA when it can describe them.  Varlen: only when the caller gave the packed
  // tensors' row count (total_k; cu_seqlens_k lives on the device), mapped as one batch entry of
  // total_k rows.  A sequence's last tile then reads the next sequence's first rows (or zeros past
  // total_k) where cp.async reads zeros: those keys are masked and their P is zero.
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  const bool varlen = p.cu_k != nullptr;
  const int map_rows = varlen ? p.total_k : p.seqlen_k, map_batch = varlen ? 1 : p.batch;
  const int box_rows = cuda::fwd_tiles(cuda::FwdKernelKind::sm90_k128, D).bk;
  const bool tma = (!varlen || p.total_k > 0) &&
                   cuda::make_kv_tensor_map(&l.tmap_k, p.k, kBf16, D, map_rows, p.heads_kv, map_batch, p.k_sr,
                                            p.k_sh, p.k_sb, box_rows) &&
                   cuda::make_kv_tensor_map(&l.tmap_v, p.v, kBf16, D, map_rows, p.heads_kv, map_batch, p.v_sr,
                                            p.v_sh, p.v_sb, box_rows);
  // Where the TMA cannot serve: the mma.sync kernel, as set above (docs/kernels.md, "Known limits",
  // states what that costs).
  if (!tma) return l;
  l.kernel = cuda::FwdKernelKind::sm90_k128;
  l.dense = dense;  // its tau = 0 instance has code of its own
  // It records where the call asks for the tile mask or the slots (its instances without the
  // recording code count no slots).
  l.record = l.record || p.slots != nullptr;
  return l;
}

bool supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// The decision tile of the kernel l names (head dims the forward does not support: d = 128's).
Tiles launch_tiles(const cuda::FwdLaunch& l, int64_t d) {
  const cuda::FwdTiles t = cuda::fwd_tiles(l.kernel, d == 64 || d == 256 ? static_cast<int>(d) : 128);
  return {t.dec_rows, t.bk};
}

// f(T{}, std::integral_constant<int, D>{}) for the call's dtype and head dim (both supported).
template <typename F>
auto with_type_and_dim(DType dtype, int64_t d, F&& f) {
  const bool bf16 = dtype == DType::bf16;
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  using I256 = std::integral_constant<int, 256>;
  if (d == 64) return bf16 ? f(__nv_bfloat16{}, I64{}) : f(__half{}, I64{});
  if (d == 256) return bf16 ? f(__nv_bfloat16{}, I256{}) : f(__half{}, I256{});
  return bf16 ? f(__nv_bfloat16{}, I128{}) : f(__half{}, I128{});
}

Status check_type_and_dim(const ForwardArgs& a) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16)
    return Status::error(std::string("dtype: the CUDA forward supports bfloat16 and float16 (got ") +
                         dtype_name(a.dtype) + ")");
  if (!supported_head_dim(a.head_dim))
    return Status::error("head_dim: the CUDA forward supports 64, 128 and 256 (got " + std::to_string(a.head_dim) +
                         ")");
  return Status::success();
}

// The kernel this call runs (choose_kernel for its dtype and head dim).
cuda::FwdLaunch plan(const ForwardArgs& a, const cuda::FwdParams& p) {
  const bool dense = rule::dense(a.tau);
  return with_type_and_dim(a.dtype, a.head_dim, [&](auto t, auto d) {
    return choose_kernel<decltype(t), decltype(d)::value>(p, dense);
  });
}

// Everything of FwdParams but the tile mask's dimensions (they follow the kernel's tiles), after the
// checks the kernels need.
Status make_params(const ForwardArgs& a, cuda::FwdParams& p) {
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
  p.causal = a.causal;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.scale_log2 = rule::scale_log2(scale);
  p.log2_tau = rule::log2_tau(a.tau);
  p.rows_before = static_cast<int>(a.rows_before);
  p.seed_lse = a.seed_lse;
  p.owns_tile0 = a.owns_tile0;
  p.owns_newest = a.owns_newest;
  return Status::success();
}
}  // namespace

Tiles forward_tiles(const ForwardArgs& a) {
  cuda::FwdParams p{};
  if (!check_type_and_dim(a) || !make_params(a, p)) return launch_tiles(cuda::FwdLaunch{}, a.head_dim);
  // The tensor maps need only an aligned address: callers that ask before they have tensors
  // (tile_sizes) get the tiles of tensors with the given (or contiguous) strides.
  const void* any_aligned = reinterpret_cast<const void*>(uintptr_t{256});
  if (p.k == nullptr) p.k = any_aligned;
  if (p.v == nullptr) p.v = any_aligned;
  return launch_tiles(plan(a, p), a.head_dim);
}

Status forward(const ForwardArgs& a) {
  Status st = check_type_and_dim(a);
  if (!st) return st;
  cuda::FwdParams p{};
  st = make_params(a, p);
  if (!st) return st;
  const cuda::FwdLaunch l = plan(a, p);
  const Tiles t = launch_tiles(l, a.head_dim);
  if ((a.block_q != 0 && a.block_q != t.block_q) || (a.block_k != 0 && a.block_k != t.block_k))
    return Status::error("block_q/block_k: the CUDA forward for these inputs uses " + std::to_string(t.block_q) +
                         "x" + std::to_string(t.block_k) + " (got " + std::to_string(a.block_q) + "x" +
                         std::to_string(a.block_k) + "); pass 0 (forward_tiles reports the tiles)");
  p.n_q_tiles_mask = static_cast<int>((a.seqlen_q + t.block_q - 1) / t.block_q);
  p.n_k_tiles_mask = static_cast<int>((a.seqlen_k + t.block_k - 1) / t.block_k);
  if (a.batch == 0 || a.seqlen_q == 0) return Status::success();
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const cudaError_t err = with_type_and_dim(a.dtype, a.head_dim, [&](auto tt, auto d) {
    return cuda::launch_fwd<decltype(tt), decltype(d)::value>(p, l, stream);
  });
  if (err != cudaSuccess)
    return Status::error(std::string("device: CUDA forward launch failed: ") + cudaGetErrorString(err));
  return Status::success();
}

}  // namespace cuda_backend
}  // namespace mala

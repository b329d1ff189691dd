// Tensor Memory Accelerator (TMA, sm_90): loads of 2-byte tiles (K, V, Q, dO), the fp32 or int32
// reduce-add of a tile into a global accumulator (the backward's dQ), and the host side that
// describes those tensors to it.
//
// A tile of ROWS keys x D columns lands in the 128-byte-swizzled GmmaTile layout: one TMA box of
// 64 columns x ROWS rows per 64-column block (kBlockBytes apart), with CU_TENSOR_MAP_SWIZZLE_128B,
// whose pattern (16-byte chunk c of row r at chunk c ^ (r % 8), 1024-byte aligned destination) is
// gmma::tile_offset's.  Rows past the sequence are zero-filled by the TMA unit (the tensor map's row
// dimension is seqlen_k), as the cp.async loader does.  One thread issues a tile's boxes and arms
// the tile's mbarrier with the byte count; the consumers wait on the mbarrier's phase
// (mbar_wait<true>, ptx.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>

namespace mala {
namespace cuda {

// ---- device ----------------------------------------------------------------------------------------

// Makes mbarrier.init visible to the TMA unit (async proxy) before a copy completes on it.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of transactions in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t mbar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mbar), "r"(bytes) : "memory");
}
// Box at coordinates (c0 = column, c1 = row, c2 = head, c3 = batch) of a rank-4 tensor map into
// shared memory; completes `bytes` on mbar.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t mbar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(mbar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Box at element c0 of a rank-1 tensor map into shared memory; completes its bytes on mbar.
__device__ __forceinline__ void tma_load_1d(uint32_t dst, const CUtensorMap* map, uint32_t mbar, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(mbar), "r"(c0)
      : "memory");
}
// Rows row0 .. row0 + ROWS - 1 of head hk, sequence b into a GmmaTile<ROWS, COLS> at dst, completing
// on mbar, whose expected bytes the caller has armed.
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_load_tile_boxes(uint32_t dst, const CUtensorMap* map, uint32_t mbar, int row0,
                                                    int hk, int b) {
#pragma unroll
  for (int c = 0; c < COLS / 64; ++c) tma_load_4d(dst + c * ROWS * 128, map, mbar, 64 * c, row0, hk, b);
}
// The same, arming mbar with the tile's bytes (one thread calls it).
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, uint32_t mbar, int row0, int hk,
                                              int b) {
  mbar_arrive_expect_tx(mbar, ROWS * COLS * 2);
  tma_load_tile_boxes<ROWS, COLS>(dst, map, mbar, row0, hk, b);
}

// Element-wise add of a shared-memory box into global memory at (c0 = column, c1 = row) of a rank-2
// fp32 or int32 tensor map (make_acc_tensor_map; each element's add is atomic, so CTAs may add to
// the same rows); one thread issues it, after the writers' fence.proxy.async and a barrier.
// Completion is tracked by bulk groups.
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until the committed bulk groups have finished reading shared memory (the source may be rewritten).
__device__ __forceinline__ void bulk_wait_group_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until the committed bulk groups are complete (their writes performed).
__device__ __forceinline__ void bulk_wait_group0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// ---- host ------------------------------------------------------------------------------------------

// The driver's cuTensorMapEncodeTiled (null when the driver does not offer it).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Tensor map of a [batch, rows, heads, d] tensor of 2-byte elements (any strides, in elements, with
// contiguous d) for boxes of 64 columns x box_rows rows.  False (the caller keeps cp.async) when the
// TMA cannot describe it: an address or a stride that is not a multiple of 16 bytes, or the driver
// refuses the map.
inline bool make_kv_tensor_map(CUtensorMap* map, const void* base, bool bf16, int d, int rows, int heads, int batch,
                               int64_t stride_row, int64_t stride_head, int64_t stride_batch, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(base) & 15) != 0) return false;
  // A dimension of size 1 is never stepped: give it a valid stride whatever the caller's is.
  const int64_t s1 = stride_row * 2;
  const int64_t s2 = heads > 1 ? stride_head * 2 : s1 * rows;
  const int64_t s3 = batch > 1 ? stride_batch * 2 : s2 * heads;
  for (int64_t s : {s1, s2, s3})
    if (s <= 0 || (s & 15) != 0 || s >= (int64_t(1) << 40)) return false;
  const cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)rows, (cuuint64_t)heads, (cuuint64_t)batch};
  const cuuint64_t strides[3] = {(cuuint64_t)s1, (cuuint64_t)s2, (cuuint64_t)s3};
  const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Tensor map of an fp32 vector of n elements for boxes of `box` elements (any start element: the
// backward's per-row scalars of a query tile, whose first row need not be 16-byte aligned).
inline bool make_f32_vec_tensor_map(CUtensorMap* map, float* base, int64_t n, int box) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(base) & 15) != 0 || n <= 0 || n >= (int64_t(1) << 31))
    return false;
  const cuuint64_t dims[1] = {(cuuint64_t)n};
  const cuuint64_t strides[1] = {4};  // unused at rank 1
  const cuuint32_t boxd[1] = {(cuuint32_t)box};
  const cuuint32_t elem_strides[1] = {1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, base, dims, strides, boxd, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Tensor map of a row-major accumulator [rows, cols] of fp32 or (fixed) int32 (cols contiguous, 128
// bytes a multiple of a row) for boxes of 128 bytes (32 columns) x box_rows rows in the 128-byte
// swizzle: chunk c of a box row r at c ^ (r % 8), so that the backward's warps store their dQ
// fragments without bank conflicts.  The reduce-add then adds fp32 or int32.
inline bool make_acc_tensor_map(CUtensorMap* map, void* base, bool fixed, int cols, int64_t rows, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(base) & 15) != 0 || cols % 32 != 0 || rows <= 0 ||
      rows >= (int64_t(1) << 31))
    return false;
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)cols * 4};
  const cuuint32_t box[2] = {32, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, fixed ? CU_TENSOR_MAP_DATA_TYPE_INT32 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims,
                strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace cuda
}  // namespace mala

// Shared-memory tiles: SmemTile for the mma.sync kernels (ldmatrix), GmmaTile (end of file) for the
// wgmma kernels.  SmemTile: swizzled layout, cp.async global->shared loads with
// zero-fill for rows past the end, and the ldmatrix lane addresses for the m16n8k16 fragments.
//
// Layout.  A tile is ROWS x D elements of a 16-bit type (bf16/fp16), row-major, D*2 bytes per row,
// split into 16-byte chunks (8 elements).  Chunk c of row r is stored at chunk (c ^ (r & 7)) of that
// row (an XOR swizzle on the low three bits of the chunk index).  Eight consecutive rows read at one
// logical chunk (what ldmatrix does: 8 row addresses of 16 bytes per matrix) land on eight distinct
// 16-byte bank groups, so ldmatrix and the cp.async stores are free of bank conflicts for D >= 64.
// (D = 32 works too, with 2-way conflicts.)
//
// Fragment conventions (PTX m16n8k16, g = lane / 4, t = lane % 4):
//   A (16x16, row-major):  a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16x8, "col"):       b0 = (k 2t..2t+1, n g)   b1 = (k 2t+8.., n g)
//   C (16x8, fp32):        c0,c1 = (g, 2t..2t+1)    c2,c3 = (g+8, 2t..2t+1)
// For S = Q K^T both Q ([row][d]) and K ([key][d]) tiles are read without transpose; for O = P V
// the V tile ([key][d]) is read with ldmatrix.trans.
#pragma once

#include <stdint.h>

#include "cuda/core/gmma_layout.h"
#include "cuda/core/ptx.cuh"

namespace mala {
namespace cuda {

template <int ROWS, int D>
struct SmemTile {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  static constexpr int kRows = ROWS;
  static constexpr int kD = D;
  static constexpr int kChunks = D / 8;           // 16-byte chunks per row
  static constexpr int kSwz = kChunks >= 8 ? 7 : kChunks - 1;
  static constexpr int kRowBytes = D * 2;
  static constexpr int kBytes = ROWS * D * 2;

  // Byte offset of (row, 16-byte chunk) inside the tile.
  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & kSwz)) << 4));
  }
  // Byte offset of element (row, col); col must be a multiple of 8 for ldmatrix/cp.async use.
  __device__ __forceinline__ static uint32_t offset_elem(int row, int col) {
    return offset(row, col >> 3) + ((col & 7) << 1);
  }

  // Asynchronous copy of rows [0, ROWS) from gmem (row r at gmem + r * row_stride elements, D
  // contiguous elements per row).  Rows >= valid_rows are zero-filled and not read.  All NTHREADS
  // threads of the block call this with their own tid; the caller commits the group.
  template <int NTHREADS, typename T>
  __device__ __forceinline__ static void load_async(uint32_t smem_base, const T* gmem, int64_t row_stride,
                                                    int valid_rows, int tid) {
    static_assert(NTHREADS % kChunks == 0 && ROWS % (NTHREADS / kChunks) == 0,
                  "tile chunks must divide evenly among threads");
    // Thread tid always copies chunk tid % kChunks of rows r0, r0 + kStep, ...: the swizzled chunk
    // is loop invariant and the source advances by one stride per step (few live registers).
    constexpr int kStep = NTHREADS / kChunks;
    const int chunk = tid % kChunks;
    const int r0 = tid / kChunks;
    const T* src = gmem + r0 * row_stride + chunk * 8;
    const int64_t step = kStep * row_stride;
    uint32_t dst = smem_base + offset(r0, chunk);
#pragma unroll
    for (int i = 0; i < ROWS / kStep; ++i) {
      const int row = r0 + i * kStep;
      const bool valid = row < valid_rows;
      // kStep is a multiple of 8 when kChunks <= NTHREADS / 8, so row & 7 (the swizzle) is fixed.
      cp_async_16(kStep % 8 == 0 ? dst + i * kStep * kRowBytes : smem_base + offset(row, chunk),
                  valid ? src : gmem, valid);
      src += step;
    }
  }

  // ---- cheap fragment addressing ----------------------------------------------------------------
  // The swizzle only permutes chunks inside a row, so for a fragment at (row0, col0) with row0 % 8 == 0
  // and col0 % 16 == 0 the lane address is  base + row0 * kRowBytes + (lane_off ^ (col0 * 2)),
  // where lane_off is the lane's offset for the fragment at (0, 0).  One XOR per fragment instead of
  // a full swizzle computation, and no per-fragment registers kept live across loops.
  // Pattern "A" (a_addr / bt_addr): lane -> row (lane & 7) + 8 * ((lane >> 3) & 1), chunk lane >> 4.
  // Pattern "B" (b_addr):           lane -> row (lane & 7) + 8 * (lane >> 4),       chunk (lane >> 3) & 1.
  __device__ __forceinline__ static uint32_t lane_off_a(int lane) {
    return offset((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
  }
  __device__ __forceinline__ static uint32_t lane_off_b(int lane) {
    return offset((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1);
  }
  __device__ __forceinline__ static uint32_t frag_addr(uint32_t base, uint32_t lane_off, int row0, int col0) {
    return base + row0 * kRowBytes + (lane_off ^ static_cast<uint32_t>(col0 * 2));
  }

  // ldmatrix_x4 lane address for an A fragment (16 rows x 16 cols) at (row0, col0): matrices
  // (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) ->
  // a0..a3.
  __device__ __forceinline__ static uint32_t a_addr(uint32_t base, int row0, int col0, int lane) {
    int row = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    int col = col0 + (lane >> 4) * 8;
    return base + offset(row, col >> 3);
  }

  // ldmatrix_x4 (non-trans) lane address for the B fragments of two n8 tiles x k16 when the tile is
  // stored [n][k] (e.g. K as [key][d] for S = Q K^T): r0,r1 = b0,b1 of n-tile n0; r2,r3 = b0,b1 of
  // n-tile n0+8.
  __device__ __forceinline__ static uint32_t b_addr(uint32_t base, int n0, int k0, int lane) {
    int row = n0 + (lane & 7) + (lane >> 4) * 8;
    int col = k0 + ((lane >> 3) & 1) * 8;
    return base + offset(row, col >> 3);
  }

  // ldmatrix_x4_trans lane address for the B fragments of k16 x two n8 tiles when the tile is
  // stored [k][n] (e.g. V as [key][d] for O = P V): r0,r1 = b0,b1 of n-tile n0; r2,r3 = b0,b1 of
  // n-tile n0+8.
  __device__ __forceinline__ static uint32_t bt_addr(uint32_t base, int k0, int n0, int lane) {
    int row = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    int col = n0 + (lane >> 4) * 8;
    return base + offset(row, col >> 3);
  }
};

// ROWS x COLS 16-bit elements in the layout of wgmma's 128-byte swizzle (gmma::tile_offset,
// cuda/gmma_layout.h): COLS/64 blocks of ROWS rows x 128 bytes, block bases 1024-byte aligned, so
// descriptors need no base offset.
//   K-major operand (rows = M or N, cols = K): sbo = 1024 (8 rows); a k16 step is +32 bytes inside a
//   block.  MN-major operand (rows = K, cols = M or N): sbo = 1024, lbo = kBlockBytes (next 64
//   columns); a k16 step is +2048 bytes (16 rows).
template <int ROWS, int COLS>
struct GmmaTile {
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "GmmaTile shape");
  static constexpr int kBlockBytes = ROWS * 128;
  static constexpr int kBytes = (COLS / 64) * kBlockBytes;
  __device__ __forceinline__ static uint32_t offset(int r, int c) { return gmma::tile_offset<ROWS>(r, c); }
  // Rows >= valid are zero-filled.  src: row 0, ld: elements between rows.
  // Thread tid copies chunk tid % CH of rows tid / CH + i * (NT / CH): a fixed trip count, fully
  // unrolled.  (A loop over c = tid, tid + NT, ... compiles to a generic loop with remainder
  // handling, about 190 instructions per 16 KB tile, on the path of every tile.)
  template <int NT, typename T>
  __device__ __forceinline__ static void load_async(uint32_t dst, const T* src, int64_t ld, int valid, int tid) {
    constexpr int CH = COLS / 8;
    static_assert(NT % CH == 0 && (ROWS * CH) % NT == 0, "GmmaTile::load_async: chunks must divide evenly");
    constexpr int kRowStep = NT / CH;
    const int ch = tid % CH, r0 = tid / CH;
    const T* s = src + static_cast<int64_t>(r0) * ld + ch * 8;
#pragma unroll
    for (int i = 0; i < ROWS * CH / NT; ++i) {
      const int r = r0 + i * kRowStep;
      const bool ok = r < valid;
      cp_async_16(dst + offset(r, ch * 8), ok ? s : src, ok);
      s += kRowStep * ld;
    }
  }
};

// The dynamic shared memory rounded up to a 1024-byte boundary, where GmmaTile blocks must start:
// the generic pointer, and its shared-space address in sbase.  (The kernels reserve 1024 bytes of
// slack for it.)
__device__ __forceinline__ unsigned char* smem_align_1024(unsigned char* raw, uint32_t& sbase) {
  const uint32_t sraw = smem_addr(raw);
  sbase = (sraw + 1023u) & ~1023u;
  return raw + (sbase - sraw);
}

}  // namespace cuda
}  // namespace mala

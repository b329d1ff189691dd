// The shared-memory tile layout of the wgmma kernels (GmmaTile, core/smem_tile.cuh), in one place that the
// CUDA kernel and a CPU test both use.  Plain C++ (no CUDA types).
//
// A ROWS x COLS tile of 16-bit elements is stored as COLS / 64 blocks of ROWS rows x 128 bytes; the
// 16-byte chunk j of row r of a block sits at chunk j ^ (r % 8).  With blocks 1024-byte aligned this
// is exactly wgmma's 128-byte swizzle (CuTe's Swizzle<3,4,3> applied to the canonical layout: byte
// address bits 4-6 XORed with bits 7-9), for the K-major operands (rows = M or N, columns = K) and
// the MN-major ones (rows = K, columns = M or N) alike, which is what the descriptors of wgmma.cuh
// assume.  tests/cpu/test_gmma_layout.cpp checks both statements.
#pragma once

#include <stdint.h>

#include "common/rule.h"  // MALA_HD

namespace mala {
namespace gmma {

// Byte offset of element (r, c) in a tile of ROWS rows (a multiple of 8).
template <int ROWS>
MALA_HD uint32_t tile_offset(int r, int c) {
  constexpr int kBlockBytes = ROWS * 128;
  return static_cast<uint32_t>((c >> 6) * kBlockBytes + r * 128 + ((((c & 63) >> 3) ^ (r & 7)) << 4) + (c & 7) * 2);
}

}  // namespace gmma
}  // namespace mala

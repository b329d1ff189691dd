// The shared-memory layout of the wgmma backward (src/cuda/gmma_layout.h): a bijection onto the
// tile's bytes, and equal to wgmma's 128-byte swizzle applied to the canonical layout, which the
// kernel's matrix descriptors (src/cuda/core/wgmma.cuh) assume.  (The GPU tests check the products.)
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/core/gmma_layout.h"

namespace {

// The tile heights the kernel uses (64: Q, dO; 128: K, V, dS^T).
uint32_t tile_offset(int rows, int r, int c) {
  return rows == 64 ? mala::gmma::tile_offset<64>(r, c) : mala::gmma::tile_offset<128>(r, c);
}

// Canonical (unswizzled) byte address of (r, c): 64-column blocks of rows x 128 bytes, row-major.
uint32_t canonical(int rows, int r, int c) { return static_cast<uint32_t>((c / 64) * rows * 128 + r * 128 + (c % 64) * 2); }
// The 128-byte swizzle on a byte address inside a 1024-byte aligned region: bits 4-6 ^= bits 7-9.
uint32_t swizzle128(uint32_t a) { return a ^ (((a >> 7) & 7u) << 4); }

TEST(GmmaLayout, BijectionOntoTheTile) {
  for (int rows : {64, 128})
    for (int cols : {64, 128}) {
      const int bytes = rows * cols * 2;
      std::vector<int> hits(bytes, 0);
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
          const uint32_t o = tile_offset(rows, r, c);
          ASSERT_LT(o, static_cast<uint32_t>(bytes)) << rows << "x" << cols << " (" << r << ", " << c << ")";
          ASSERT_EQ(o % 2, 0u);
          ++hits[o];
          ++hits[o + 1];
        }
      for (int b = 0; b < bytes; ++b) ASSERT_EQ(hits[b], 1) << rows << "x" << cols << " byte " << b;
    }
}

TEST(GmmaLayout, Is128ByteSwizzleOfCanonical) {
  for (int rows : {64, 128})
    for (int cols : {64, 128})
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c)
          ASSERT_EQ(tile_offset(rows, r, c), swizzle128(canonical(rows, r, c))) << rows << "x" << cols << " (" << r
                                                                                << ", " << c << ")";
}

TEST(GmmaLayout, SixteenByteChunksStayContiguous) {
  // cp.async writes 16-byte chunks of 8 consecutive columns; they must land in 16 contiguous bytes.
  for (int r = 0; r < 128; ++r)
    for (int c = 0; c < 128; c += 8) {
      const uint32_t o = tile_offset(128, r, c);
      EXPECT_EQ(o % 16, 0u);
      for (int e = 1; e < 8; ++e) EXPECT_EQ(tile_offset(128, r, c + e), o + 2u * e);
    }
}

TEST(GmmaLayout, SwizzleIsNotTheIdentity) {
  // The test above could not fail if the swizzle were dropped on both sides: pin one moved chunk.
  EXPECT_EQ(tile_offset(64, 1, 0), 128u + 16u);   // row 1, chunk 0 -> chunk 1
  EXPECT_EQ(tile_offset(64, 7, 56), 7u * 128u);   // row 7, chunk 7 -> chunk 0
  EXPECT_EQ(tile_offset(64, 8, 8), 8u * 128u + 16u);  // the pattern repeats every 8 rows
}

}  // namespace

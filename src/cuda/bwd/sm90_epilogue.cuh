// The warp-specialized backward's outputs (bwd/sm90_kernel.cuh): dQ per retained tile, dK and dV once
// per CTA.
//   dQ: each consumer warpgroup stages its half of the tile's dQ (64 x d in shared memory: fp32, or in
//     the deterministic mode the int32 of BwdParams::dq_fixed, whose sums do not depend on the order
//     of the adds) in the writer's buffer (bwd_sm90_stage_dq); the dQ writer (warp 2 of the producer
//     warpgroup, one thread: bwd_sm90_write_dq) adds it into the dQ accumulator with one TMA
//     reduce-add per 128-byte column box, off the consumers' path (the buffer handed over through a
//     full and an empty mbarrier).
//   dK (scaled) and dV: from the consumers' registers after the last tile (bwd_sm90_store_dkdv).
#pragma once

#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/tma.cuh"

namespace mala {
namespace cuda {

// The dQ writer: per post, the tile's first accumulator row from s_dq_row (-1: no more tiles), then
// its boxes added from the buffer at sDQ.  The buffer goes back to the consumers as soon as the TMA
// has read it.
template <int D, bool kDet>
__device__ __forceinline__ void bwd_sm90_write_dq(const BwdTmaMaps& maps, const uint32_t& sDQ,
                                                  const uint32_t& mb_dq_full, const uint32_t& mb_dq_empty,
                                                  volatile int* const& s_dq_row) {
  using C = BwdWs<D, kDet>;
  for (int k = 0;; ++k) {
    mbar_wait<true>(mb_dq_full, bwd_ws_parity(k));
    const int row = s_dq_row[0];  // (read before the arrival that gives the buffer back)
    if (row < 0) break;
#pragma unroll
    for (int b = 0; b < C::kDqBoxes; ++b)
      tma_reduce_add_2d(&maps.dq, sDQ + b * (C::BQ * 128), C::kDqBoxCols * b, row);
    bulk_commit_group();
    bulk_wait_group_read0();
    mbar_arrive(mb_dq_empty);
  }
  bulk_wait_group0();
}

// A consumer warpgroup's dQ (m64 x D/2, columns dq_col0..) -> the writer's buffer: boxes of 128 bytes
// (32 fp32 or int32 columns) x 64 rows, 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8));
// warpgroup g writes the boxes of its D / 2 columns.  Accumulator element 4n + 2hh + c: row
// 16 wl + gid + 8 hh, column 8n + 2 tig + c of the warpgroup's D / 2.  unit_t: the tile's rows' units
// (kDet).
template <int D, bool kDet>
__device__ __forceinline__ void bwd_sm90_stage_dq(const float (&dq)[D / 4], const uint32_t& sDQ, const int& dq_col0,
                                                  const int& wl, const int& gid, const int& tig,
                                                  const float* const& unit_t) {
  using C = BwdWs<D, kDet>;
  constexpr int BQ = C::BQ, kDqCols = D / 2;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = wl * 16 + gid + hh * 8;
    // Fixed point: the row's unit (BwdParams::dq_unit) gives the same integers whatever the order of adds.
    [[maybe_unused]] const float unit = kDet ? unit_t[r] : 1.f;
#pragma unroll
    for (int n = 0; n < kDqCols / 8; ++n) {
      // Elements 4n + 2hh and 4n + 2hh + 1: row r, chunk ((n % 4) << 1 | tig / 2) ^ (r % 8) of box n / 4.
      const uint32_t chunk = static_cast<uint32_t>(((n & 3) << 1) | (tig >> 1)) ^ static_cast<uint32_t>(r & 7);
      const uint32_t addr = sDQ + (dq_col0 / 32 + (n >> 2)) * (BQ * 128) + r * 128 + (chunk << 4) + ((tig & 1) << 3);
      const float lo = dq[4 * n + 2 * hh], hi = dq[4 * n + 2 * hh + 1];
      if constexpr (kDet)
        asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(__float2int_rn(lo * unit)),
                     "r"(__float2int_rn(hi * unit))
                     : "memory");
      else
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(lo), "f"(hi) : "memory");
    }
  }
}

// dK (scaled) and dV of this thread's two key rows krow, krow + 8 (those < kn).  Accumulator element
// 4n + 2hh + c: key krow + 8hh, dim 8n + 2tig + c.
template <typename T, int D>
__device__ __forceinline__ void bwd_sm90_store_dkdv(const BwdParams& p, const BwdWork& w, const int& krow,
                                                    const int& kn, const int& tig, const float (&dk)[D / 2],
                                                    const float (&dv)[D / 2]) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = krow + hh * 8;
    if (r >= kn) continue;
    bwd_store_dkdv_row<T, D, D / 8>(p, w, r, 2 * tig, [&](int n) {
      return make_float4(dk[4 * n + 2 * hh], dk[4 * n + 2 * hh + 1], dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1]);
    });
  }
}

}  // namespace cuda
}  // namespace mala

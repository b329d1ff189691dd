// The MALA tile test applied to mma fragments, warp-wide.  The rule itself is rule::row_allows_skip
// (src/common/rule.h); this file only gathers its inputs from fragments and votes.
//
// Fragment rows: with m16n8k16 C fragments a lane holds rows g and g+8 (g = lane / 4) of each m16
// tile, and the four lanes of a quad hold the same rows.  Arrays indexed [mt][h] refer to row
// 16*mt + g + 8*h of the warp's block.  All values are in the log2 domain in the kernels:
//   tile_max = scale*log2(e) * max over the row's legal keys in the tile (-inf when none),
//   log_norm = m + log2(l) of the running state (online rule) or the saved lse*log2(e) (offline),
//   log_thr  = log2(tau) - log2(L_q)  (rule::log_threshold).
// A row that has no legal key in the tile (tile_max = -inf, also rows past seqlen_q) never blocks a
// skip; a row with nothing retained yet (l = 0 -> log_norm = -inf) always blocks it.
#pragma once

#include <math.h>

#include "common/rule.h"
#include "cuda/core/ptx.cuh"

namespace mala {
namespace cuda {

// Max of this lane's entries of rows (g, g + 8) of m16 tile mt of a score fragment s[MT][NT][4]
// (raw or scaled; masked entries -inf), before the reduction over the quad.
// A balanced tree (depth log2(2 NT) instead of a chain of 2 NT maxes: this sits on the path from the
// scores to the skip decision).
template <int MT, int NT>
__device__ __forceinline__ void lane_row_max(const float (&s)[MT][NT][4], int mt, float& a, float& b) {
  static_assert((NT & (NT - 1)) == 0, "lane_row_max: NT must be a power of two");
  float ra[NT], rb[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    ra[nt] = fmaxf(s[mt][nt][0], s[mt][nt][1]);
    rb[nt] = fmaxf(s[mt][nt][2], s[mt][nt][3]);
  }
#pragma unroll
  for (int w = NT / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int i = 0; i < w; ++i) {
      ra[i] = fmaxf(ra[i], ra[i + w]);
      rb[i] = fmaxf(rb[i], rb[i + w]);
    }
  }
  a = ra[0];
  b = rb[0];
}
// The reduction of lane_row_max's parts over the quad, in place: afterwards every lane of the quad
// holds the row's max.  (The forward kernels vote on the parts and reduce only for a retained tile.)
template <int MT>
__device__ __forceinline__ void quad_row_max(float (&x)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    x[mt][0] = warp_max_quad(x[mt][0]);
    x[mt][1] = warp_max_quad(x[mt][1]);
  }
}

// True when every fragment row held by this lane allows the skip (no vote).
// tile_max, log_norm, log_thr: [MT][2] as above, log2 domain.
template <int MT>
__device__ __forceinline__ bool lane_rows_allow_skip(const float (&tile_max)[MT][2], const float (&log_norm)[MT][2],
                                                     const float (&log_thr)[MT][2]) {
  bool ok = true;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) ok &= rule::row_allows_skip(tile_max[mt][h], log_norm[mt][h], log_thr[mt][h]);
  return ok;
}

// True when some fragment row held by this lane blocks the skip, from the lane's part of each row's
// raw (unscaled) max and the rows' bounds (rule::skip_bound_raw: one comparison per row).
template <int MT>
__device__ __forceinline__ bool lane_rows_block_skip_raw(const float (&raw_max)[MT][2], const float (&bound)[MT][2]) {
  bool block = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) block |= !rule::row_allows_skip_raw(raw_max[mt][h], bound[mt][h]);
  return block;
}

// Warp vote: true iff every lane allows the skip.  The decision is then uniform over the warp, as
// the mma needs (use __syncthreads_and instead when the whole CTA must agree).
__device__ __forceinline__ bool warp_vote_skip(bool lane_ok) { return __all_sync(0xffffffffu, lane_ok); }

// The online (forward/decode) test for a warp-owned block of 16*MT rows: log_norm = m + log2(l)
// from the running state (m in scaled log2 units, l the full row sum, reduced over the quad).
// Returns the warp-uniform decision: true = skip the post-score work of this tile.
template <int MT>
__device__ __forceinline__ bool warp_tile_skip_online(const float (&tile_max)[MT][2], const float (&m)[MT][2],
                                                      const float (&l)[MT][2], const float (&log_thr)[MT][2]) {
  float log_norm[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) log_norm[mt][h] = m[mt][h] + __log2f(l[mt][h]);  // l = 0 -> -inf
  return warp_vote_skip(lane_rows_allow_skip<MT>(tile_max, log_norm, log_thr));
}

}  // namespace cuda
}  // namespace mala

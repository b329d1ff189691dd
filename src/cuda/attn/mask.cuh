// Causal / bounds masking of score fragments (m16n8k16 C layout: lane holds rows g and g+8 of each
// m16 tile, columns 2t and 2t+1 of each n8 tile; g = lane / 4, t = lane % 4).
//
// The rule is "column c is legal for row r iff c < L_r", where L_r = rule::visible_keys(r, ...) for a
// valid row (bottom-right causal, or seqlen_k when not causal) and 0 for a row past the end.  Callers
// precompute L for their fragment rows once per kernel (row_limits) and mask only the tiles that
// need it (needs_mask): tiles whose last column reaches min L of the warp's rows.
#pragma once

#include <math.h>

#include "common/rule.h"

namespace mala {
namespace cuda {

// L for the 2*MT fragment rows of this lane.  row0: first row of the warp's block (sequence-local);
// rows r >= seqlen_q get 0.  lim[mt][h] is for row row0 + 16*mt + g + 8*h.
template <int MT>
__device__ __forceinline__ void row_limits(int (&lim)[MT][2], int row0, int lane, int seqlen_q, int seqlen_k,
                                           bool causal) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int r = row0 + mt * 16 + (lane >> 2) + h * 8;
      lim[mt][h] = r < seqlen_q ? rule::visible_keys(r, seqlen_q, seqlen_k, causal) : 0;
    }
}

// Sets s[mt][nt][*] to -inf where column col0 + 8*nt + 2t + {0,1} >= lim of its row.
template <int MT, int NT>
__device__ __forceinline__ void apply_mask(float (&s)[MT][NT][4], const int (&lim)[MT][2], int col0, int lane) {
  int c = col0 + (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int col = c + nt * 8 + (e & 1);
        if (col >= lim[mt][e >> 1]) s[mt][nt][e] = -INFINITY;
      }
}

}  // namespace cuda
}  // namespace mala

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

// Whether a key-major tile (keys [kb, kb + keys), query rows [q0, q0 + rows)) reaches past an end of
// either sequence or crosses the causal diagonal: only such tiles need apply_mask_keys_x_rows.
__device__ __forceinline__ bool keys_x_rows_needs_mask(int q0, int rows, int kb, int keys, int seqlen_q, int seqlen_k,
                                                       bool causal) {
  return q0 + rows > seqlen_q || kb + keys > seqlen_k || (causal && kb + keys - 1 > q0 + seqlen_k - seqlen_q);
}
// Causal launches run the longest query tiles (the last ones) first: the tile of block x of n.
__device__ __forceinline__ int longest_first_query_tile(bool causal) {
  return causal ? static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
}

// The same rule on transposed fragments (S^T = K Q^T of the key-major backward: rows are keys,
// columns query rows): element 4n + 2h + c is key key0 + 8h, query row q0 + 8n + 2t + c; -inf where
// the query row does not see the key or is past seqlen_q.  NT: n8 tiles of query rows.
template <int NT>
__device__ __forceinline__ void apply_mask_keys_x_rows(float (&s)[4 * NT], int key0, int q0, int lane, int seqlen_q,
                                                       int seqlen_k, bool causal) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int qr = q0 + n * 8 + 2 * (lane & 3) + c;
      const int L = qr < seqlen_q ? rule::visible_keys(qr, seqlen_q, seqlen_k, causal) : 0;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (key0 + h * 8 >= L) s[4 * n + 2 * h + c] = -INFINITY;
    }
}

}  // namespace cuda
}  // namespace mala

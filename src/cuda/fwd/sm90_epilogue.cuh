// The sm_90 forward's epilogue (fwd/sm90_kernel.cuh), per consumer warp after its last tile: the
// dense instance's records (every legal tile retained), the slots, then fwd_epilogue
// (fwd/common.cuh): O = acc / l, lse = m + log l and the slots, from registers to global memory.
#pragma once

#include <stdint.h>

#include "cuda/fwd/common.cuh"
#include "cuda/fwd/sm90_traits.cuh"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

// The warp's rows start at row_w; dec_hi: its decision tile's newest legal tile; mask_row: where it
// records (fwd_sm90_consume), retained: the decision tiles it retained (kRecord).
template <typename T, int D, bool kDense>
__device__ __forceinline__ void fwd_sm90_epilogue(const FwdParams& p, const FwdSeq<T>& sq, const int& b,
                                                  const int& h, const int& row_w, const int& lane,
                                                  const int& dec_hi, uint8_t* const& mask_row, const int& retained,
                                                  const float (&m)[1][2], float (&l)[1][2],
                                                  float (&acc)[1][D / 8][4]) {
  constexpr int BK = FwdK128<D>::BK;
  int slots;
  if constexpr (kDense) {
    softmax_quad_row_sums<1>(l);
    // Every legal tile of the decision tile retained.
    if (mask_row)
      for (int kt = lane; kt <= dec_hi; kt += 32) mask_row[kt] = kTileRetained;
    slots = (dec_hi + 1) * BK;
  } else {
    slots = retained * BK;  // 0 where !kRecord: the call asked for no slots
  }
  fwd_epilogue<T, 1, D / 8>(p, sq, b, h, row_w, lane, m, l, acc, slots);
}

}  // namespace cuda
}  // namespace mala

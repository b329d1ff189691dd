// Forward kernel parameters (dispatch.cu fills them, the kernels read them), and through tiles.h the
// tile table.  No CUDA types: plain C++ so tests and benchmarks can read the configuration too.
#pragma once

#include <math.h>
#include <stdint.h>

#include "cuda/fwd/tiles.h"

namespace mala {
namespace cuda {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;          // optional
  int32_t* slots;      // optional
  uint8_t* tile_mask;  // optional, [batch, heads_q, n_q_tiles, n_k_tiles]
  // element strides (resolved: never all zero)
  int64_t q_sb, q_sr, q_sh;
  int64_t k_sb, k_sr, k_sh;
  int64_t v_sb, v_sr, v_sh;
  int64_t o_sb, o_sr, o_sh;
  const int32_t* cu_q;  // varlen when non-null (then the *_sb strides are unused)
  const int32_t* cu_k;
  int total_k;                    // varlen: rows of the packed k and v (0 = not known)
  int batch, seqlen_q, seqlen_k;  // maxima for varlen
  int heads_q, heads_kv, group;   // group = heads_q / heads_kv
  int n_q_tiles_mask, n_k_tiles_mask;
  bool causal;
  float scale_log2;  // softmax_scale * log2(e)
  float log2_tau;    // -inf for tau = 0
  // The call as one split of a longer sequence (ForwardArgs: rows_before, seed_lse, owns_tile0,
  // owns_newest; fwd/common.cuh applies them).  Off: rows_before = -1, seed_lse = null.
  int rows_before;
  const float* seed_lse;  // [batch, heads_q, seqlen_q], natural log
  bool owns_tile0, owns_newest;
};

}  // namespace cuda
}  // namespace mala

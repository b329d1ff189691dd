// Forward kernel parameters and the per-head-dim tile configuration (shared by forward.cu and the
// instantiation files under instantiations/).  No CUDA types: plain C++ so tests/bench can read the
// configuration too.
#pragma once

#include <math.h>
#include <stdint.h>

namespace mala {
namespace cuda {

// Tile configuration of the forward kernel for a head dim.  A CTA of kWarps warps owns
// kWarps * 16 * kMT consecutive query rows; each warp owns a contiguous aligned block of 16*kMT rows
// and decides skips for its block alone, so the decision tile (the Bq reported by forward_tiles) is
// 16*kMT rows by kBk keys.
template <int D> struct FwdConfig;
template <> struct FwdConfig<64>  { static constexpr int kMT = 2, kWarps = 4, kBk = 64; };
template <> struct FwdConfig<128> { static constexpr int kMT = 2, kWarps = 4, kBk = 64; };
template <> struct FwdConfig<256> { static constexpr int kMT = 1, kWarps = 4, kBk = 32; };

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
};

// tau = 0: nothing can be skipped, and the launchers run each kernel's dense instance.
inline bool fwd_tau_zero(const FwdParams& p) { return !(p.log2_tau > -INFINITY); }

}  // namespace cuda
}  // namespace mala

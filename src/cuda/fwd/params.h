// Forward kernel parameters, the per-head-dim tile configuration and the head dims each kernel is
// built for (shared by dispatch.cu and the kernels).  No CUDA types: plain C++ so tests and
// benchmarks can read the configuration too.
#pragma once

#include <math.h>
#include <stdint.h>

namespace mala {
namespace cuda {

// Tile configuration of the forward kernel for a head dim.  A CTA of kWarps warps owns
// kWarps * 16 * kMT consecutive query rows; each warp owns a contiguous aligned block of 16*kMT rows
// and decides skips for its block alone, so the decision tile (the Bq reported by forward_tiles) is
// 16*kMT rows by kBk keys.
// kDenseInstance: the mma.sync kernel has a tau = 0 instance without the test, the vote and the
// lazy V.  Not at d = 128, where that instance ran slower than the general one (its register
// allocation; on sm_90 the wgmma kernels serve d = 128 anyway).
template <int D> struct FwdConfig;
template <> struct FwdConfig<64>  { static constexpr int kMT = 2, kWarps = 4, kBk = 64; static constexpr bool kDenseInstance = true; };
template <> struct FwdConfig<128> { static constexpr int kMT = 2, kWarps = 4, kBk = 64; static constexpr bool kDenseInstance = false; };
template <> struct FwdConfig<256> { static constexpr int kMT = 1, kWarps = 4, kBk = 32; static constexpr bool kDenseInstance = true; };

// The head dims each wgmma kernel is built for.
constexpr bool fwd_has_sm90(int d) { return d == 128; }
constexpr bool fwd_has_sm90_ws(int d) { return d == 64 || d == 128 || d == 256; }
constexpr bool fwd_has_sm90_k128(int d) { return d == 64 || d == 128 || d == 256; }
// The 128-key kernel's key tile (its K and V tensor maps' box rows, and its decision tile's keys):
// 128 keys, 64 at d = 256 (where O's 128 registers a thread leave room for a 64-key S only).
constexpr int fwd_k128_bk(int d) { return d == 256 ? 64 : 128; }
// Its decision tile's rows: a warp's at d = 128, a warp pair's at d = 64 and 256 (FwdK128::kWarpVote).
constexpr int fwd_k128_dec_rows(int d) { return d == 128 ? 16 : 32; }

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

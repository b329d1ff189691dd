// Parameters of the fused MALA backward kernels (bwd/dispatch.cu builds them, the kernels read them),
// and through tiles.h the tile table.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "cuda/bwd/tiles.h"

namespace mala {
namespace cuda {

struct BwdParams {
  // Inputs (element strides; head_dim contiguous).  Varlen: row strides index the packed rows and
  // the batch strides are unused.
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  int64_t q_b, q_r, q_h;
  int64_t k_b, k_r, k_h;
  int64_t v_b, v_r, v_h;
  int64_t do_b, do_r, do_h;
  // Outputs written directly by the main kernel (dk/dv when heads_per_cta == group).
  void* dk;
  void* dv;
  void* dq;  // d = 256 on Hopper: written by the dQ kernel (bwd/sm90_256_dq_kernel.cuh); else via dq_acc
  int64_t dq_b, dq_r, dq_h;
  int64_t dk_b, dk_r, dk_h;
  int64_t dv_b, dv_r, dv_h;
  int32_t* bwd_slots;   // optional, zeroed by the preprocess kernel
  uint8_t* tile_mask;   // optional, zeroed (kTileIllegal) before the main kernel; at d = 256 on Hopper
                        // with tau > 0 always (the dQ kernel reads the decisions from it)

  const int32_t* cu_q;  // varlen when non-null
  const int32_t* cu_k;

  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, group;
  int n_q_tiles, n_k_tiles;
  int64_t rows_q_cap, rows_k_cap;  // batch * seqlen (>= total rows for varlen)
  bool causal;
  float scale;          // softmax scale
  float scale_log2;     // scale * log2(e)
  float log2_tau;       // log2(tau)
  int rows_before;      // BackwardArgs::rows_before (rule::threshold_length; -1 = off)

  // Workspace (fp32).  D: [heads_q, rows_q_cap]; dq_acc: [heads_q, rows_q_cap, d];
  // dk_acc/dv_acc: [heads_kv, rows_k_cap, d] or null (direct dK/dV stores).
  float* dsum;
  float* lse2;           // [heads_q, rows_q_cap]: lse in log2 units, -inf -> 0 (preprocess kernel)
  float* bound2;         // [heads_q, rows_q_cap], tau > 0: the test's bound on raw scores (preprocess kernel)
  float* dq_acc;
  float* dk_acc;
  float* dv_acc;
  int64_t kv_slice;     // > 0: dk_acc/dv_acc hold one slice per head split this many floats apart,
                        // stored (deterministic mode); 0: partials added with atomics
  int heads_per_cta;    // query heads of one KV group handled by one CTA
  int head_splits;      // group / heads_per_cta
  int q_stages;         // 2 or 3 shared-memory stages of Q (3 where the shared memory allows)
  // Deterministic mode (warp-specialized kernel, d = 64 and 128): dq_fixed instead of dq_acc.  Each
  // CTA adds its partial of row g as the int32 rint(x * dq_unit[g]) into dq_fixed [heads_q,
  // rows_q_cap, d]; integer adds give the same sum in any order.  dq_unit (a power of two per row,
  // dsum's layout; bwd_dq_fixed_unit) puts the row's largest possible |dQ| at 2^kDqFixedBits.
  // Null: fp32 adds into dq_acc in arrival order.
  int32_t* dq_fixed;
  const float* dq_unit;
  // BackwardArgs::forward_tile_mask, [batch, heads_q, fwd_n_q_tiles, fwd_n_k_tiles] over forward tiles
  // of fwd_bq x fwd_bk; null: every legal tile is scored.  (Warp-specialized kernel, d = 64 and 128.)
  const uint8_t* fwd_mask;
  int fwd_bq, fwd_bk, fwd_n_q_tiles, fwd_n_k_tiles;
};

// What the TMA reads (Q, dO, K, V; the per-row lse, skip bound, D and in deterministic mode dQ's
// fixed-point unit) and adds into (the fp32 or fixed-point dQ accumulator), for the warp-specialized
// kernels (a kernel parameter beside BwdParams).
struct BwdTmaMaps {
  CUtensorMap q, dout, k, v, dq, lse, bound, dsum, unit;
  CUtensorMap k32, v32;  // d = 256: K and V in boxes of 32 rows (the dQ kernel's key steps)
};
// The warp-specialized kernel at d = 64 / 128 reads forward_tile_mask when a CTA visits at most this
// many tiles (heads_per_cta x query tiles): one bit each in shared memory.
constexpr int kBwdWsScoredTiles = 8192;

// Fixed-point dQ (deterministic mode): the bound on a row's |dQ| (before the softmax scale, with P's
// row sum bounded by 1 + tau: the forward's lse leaves out the skipped tiles' mass, less than tau
// times the retained) maps to at most 2^kDqFixedBits, so every partial sum fits an int32 with 2x to
// spare for rounding.  Each add's rounding error is at most 2^-31 of the bound: an fp32 add's is
// 2^-24 of the running sum, the same once that sum reaches 1/128 of the bound, and over 1024 adds
// either typically stays below the bf16/fp16 output's rounding on any row whose |dQ| is above 2^-17
// of the bound (docs/kernels.md, "Deterministic mode").  4-byte integers move the bytes of the
// default mode's fp32 adds through the L2.
constexpr int kDqFixedBits = 30;

// Bytes of dynamic shared memory of the main kernel with q_stages Q stages (host-computable).
template <int D>
constexpr int bwd_smem_bytes(int q_stages) {
  // Mirrors BwdKernel<T, D> (kernel_sm80.cuh): K, V, dO x2, dS^T x2, D x2, lse x3, thr x3, vote 128 B, Q x q_stages.
  return 2 * BwdConfig<D>::BK * D * 2 + 2 * BwdConfig<D>::BQ * D * 2 + 2 * BwdConfig<D>::BK * BwdConfig<D>::BQ * 2 +
         8 * BwdConfig<D>::BQ * 4 + 128 + q_stages * BwdConfig<D>::BQ * D * 2;
}

}  // namespace cuda
}  // namespace mala

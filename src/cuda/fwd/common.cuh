// Pieces the forward kernels share: the sequence a CTA works on, the epilogue, and the wgmma
// kernels' per-warp mask, row max and test inputs (their accumulator layout is the mma.sync C
// layout per warp, so these are the mma.sync fragment functions with MT = 1).
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "cuda/attn/mask.cuh"
#include "cuda/attn/online_softmax.cuh"
#include "cuda/attn/skip.cuh"
#include "cuda/core/ptx.cuh"
#include "cuda/core/wgmma.cuh"
#include "cuda/fwd/params.h"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

// The sequence one CTA works on: lengths (varlen or padded) and the row-0 pointers of its head.
template <typename T>
struct FwdSeq {
  int Nq, Nk, q_off, k_off;  // k_off: the sequence's first row in the packed k and v (varlen)
  const T *q, *k, *v;
  T* o;
  // The most keys any of the rows [r0, r0 + rows) sees: its last row inside the sequence's (L is
  // non-decreasing in the row); 0 when no row is inside.
  __device__ __forceinline__ int max_visible(int r0, int rows, bool causal) const {
    const int last = min(r0 + rows, Nq) - 1;
    return last >= r0 ? rule::visible_keys(last, Nq, Nk, causal) : 0;
  }
  // How many key tiles (of bk keys) the rows [r0, r0 + rows) reach, and the last of them (-1: none).
  __device__ __forceinline__ int key_tiles(int r0, int rows, int bk, bool causal) const {
    return rule::ceil_div(max_visible(r0, rows, causal), bk);
  }
  __device__ __forceinline__ int last_tile(int r0, int rows, int bk, bool causal) const {
    return key_tiles(r0, rows, bk, causal) - 1;
  }
};
template <typename T>
__device__ __forceinline__ FwdSeq<T> fwd_seq(const FwdParams& p, int b, int h) {
  FwdSeq<T> sq;
  sq.Nq = p.seqlen_q;
  sq.Nk = p.seqlen_k;
  sq.q_off = 0;
  sq.k_off = 0;
  int64_t q_base, k_base, v_base, o_base;
  const int hk = h / p.group;
  if (p.cu_q) {
    sq.q_off = p.cu_q[b];
    sq.Nq = p.cu_q[b + 1] - sq.q_off;
    q_base = sq.q_off * p.q_sr;
    o_base = sq.q_off * p.o_sr;
  } else {
    q_base = b * p.q_sb;
    o_base = b * p.o_sb;
  }
  if (p.cu_k) {
    sq.k_off = p.cu_k[b];
    sq.Nk = p.cu_k[b + 1] - sq.k_off;
    k_base = sq.k_off * p.k_sr;
    v_base = sq.k_off * p.v_sr;
  } else {
    k_base = b * p.k_sb;
    v_base = b * p.v_sb;
  }
  sq.q = static_cast<const T*>(p.q) + q_base + h * p.q_sh;
  sq.k = static_cast<const T*>(p.k) + k_base + hk * p.k_sh;
  sq.v = static_cast<const T*>(p.v) + v_base + hk * p.v_sh;
  sq.o = static_cast<T*>(p.o) + o_base + h * p.o_sh;
  return sq;
}

// Epilogue of a warp's block of 16*MT rows starting at row_w: O = acc / l, lse = m + log l (natural
// log), slots = the keys of the retained decision tiles (0 for rows with L = 0, as the CPU counts).
template <typename T, int MT, int DT>
__device__ __forceinline__ void fwd_epilogue(const FwdParams& p, const FwdSeq<T>& sq, int b, int h, int row_w,
                                             int lane, const float (&m)[MT][2], const float (&l)[MT][2],
                                             float (&acc)[MT][DT][4], int slots) {
  float lse[MT][2];
  softmax_finalize<MT, DT>(m, l, acc, lse);
  const int g = lane >> 2, t = lane & 3;
  int lim[MT][2];
  row_limits<MT>(lim, row_w, lane, sq.Nq, sq.Nk, p.causal);
  int64_t lse_base = 0;
  if (p.lse || p.slots) {
    lse_base = p.cu_q ? (int64_t)h * p.cu_q[p.batch] + sq.q_off : ((int64_t)b * p.heads_q + h) * p.seqlen_q;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_w + mt * 16 + g + hh * 8;
      if (r >= sq.Nq) continue;
      T* orow = sq.o + (int64_t)r * p.o_sr;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = pack2<T>(acc[mt][dt][2 * hh], acc[mt][dt][2 * hh + 1]);
      if (t == 0) {
        if (p.lse) p.lse[lse_base + r] = lse[mt][hh];
        if (p.slots) p.slots[lse_base + r] = lim[mt][hh] > 0 ? slots : 0;
      }
    }
}

// ---- the call as one split of a longer sequence (FwdParams::rows_before, seed_lse, owns_*) -------
// The log2 threshold of row r (sequence-local), which sees L keys in this call: log2(tau / L_q) with
// L_q = L, or with rows_before >= 0 the row's whole length rows_before + r + 1.
__device__ __forceinline__ float fwd_row_threshold(const FwdParams& p, int r, int L) {
  return row_log2_threshold(p.log2_tau, rule::threshold_length(L, r, p.rows_before));
}
// A seeded split's anchor mass for row r in the kernels' log2 units, log2 Z_anchor (-inf when the
// call is not seeded or r is past the end): the start of the test's denominator, which
// seeded_log2_norm then grows with the split's own retained mass.
__device__ __forceinline__ float fwd_row_seed(const FwdParams& p, int b, int h, int r, int Nq) {
  if (p.seed_lse == nullptr || r >= Nq) return -INFINITY;
  return p.seed_lse[((int64_t)b * p.heads_q + h) * p.seqlen_q + r] * rule::kLog2e;
}
// The test's denominator of row r in the seeded instances (kSeeded): log2 of the own retained mass
// (m, l) plus the anchor mass, re-read after each retained tile rather than held in registers.
__device__ __forceinline__ float fwd_log2_norm(const FwdParams& p, int b, int h, int r, int Nq, float m, float l) {
  return p.seed_lse ? seeded_log2_norm(fwd_row_seed(p, b, h, r, Nq), m, l) : log2_norm(m, l);
}
// Row r's raw-score skip bound after a retained tile (rule::skip_bound_raw) from its m and l: the
// test's denominator m + log2 l, with a seeded split's anchor mass in the kSeeded instances.
template <bool kSeeded>
__device__ __forceinline__ float fwd_row_bound(const FwdParams& p, int b, int h, int r, int Nq, float m, float l,
                                               float log_thr, float inv_scale) {
  return rule::skip_bound_raw(kSeeded ? fwd_log2_norm(p, b, h, r, Nq, m, l) : log2_norm(m, l), log_thr, inv_scale);
}
// The anchor tiles a seeded split holds for the decision tile whose first row is r0 and newest legal
// tile last_tile, retained untested: tile 0 when owns_tile0 (held0), and the rows' newest legal
// tiles [lo, hi] (rule::newest_tile of the first row's L up to last_tile) when owns_newest; lo > hi:
// none.  Computed once per decision tile; the loop tests fwd_forced_tile(anchors, j).
struct FwdAnchors {
  bool held0;
  int lo, hi;
};
template <int BK>
__device__ __forceinline__ FwdAnchors fwd_held_anchors(const FwdParams& p, int r0, int last_tile, int Nq, int Nk) {
  FwdAnchors a{false, 1, 0};  // none
  if (p.seed_lse == nullptr) return a;
  a.held0 = p.owns_tile0 && last_tile >= 0;
  if (p.owns_newest && r0 < Nq) {
    a.lo = rule::newest_tile(max(rule::visible_keys(r0, Nq, Nk, p.causal), 1), BK);
    a.hi = last_tile;
  }
  return a;
}
__device__ __forceinline__ bool fwd_forced_tile(const FwdAnchors& a, int j) {
  return rule::is_held_anchor_tile(j, a.held0, a.lo, a.hi);
}

// The wgmma forwards' per-lane test inputs for the warp's 16 rows from row_w: the log2 threshold of
// each of the lane's two rows and the running normaliser (nothing retained yet: -inf, or a seeded
// split's anchor mass).
__device__ __forceinline__ void wgmma_fwd_test_inputs(float (&log_thr)[1][2], float (&log_norm)[1][2], int b, int h,
                                                      int row_w, int lane, int Nq, int Nk, const FwdParams& p) {
  int lim[1][2];
  row_limits<1>(lim, row_w, lane, Nq, Nk, p.causal);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = row_w + (lane >> 2) + hh * 8;
    log_thr[0][hh] = fwd_row_threshold(p, r, lim[0][hh]);
    log_norm[0][hh] = fwd_row_seed(p, b, h, r, Nq);
  }
}
// The wgmma forwards' Q: a consumer warpgroup's 64 query rows from row_wg into its shared tile at sQ
// (cp.async; rows past the sequence are zeros), then, kRegs, warp wl's 16 rows as the A fragments of
// the KS k-steps of Q K^T; otherwise (Q an ss-wgmma operand) the writes made visible to wgmma.
template <typename QTile, int KS, bool kRegs, typename T>
__device__ __forceinline__ void wgmma_fwd_load_q(uint32_t sQ, const FwdSeq<T>& sq, const FwdParams& p, int row_wg,
                                                 int wg, int wl, int lane, uint32_t (&qreg)[kRegs ? KS : 1][4]) {
  QTile::template load_async<128>(sQ, sq.q + (int64_t)row_wg * p.q_sr, p.q_sr, sq.Nq - row_wg, 32 * (wl & 3) + lane);
  cp_async_commit();
  cp_async_wait<0>();
  if constexpr (!kRegs) fence_proxy_async_smem();
  warpgroup_barrier_sync(wg);
  if constexpr (kRegs) {
    const uint32_t q_lane = QTile::lane_off_a(lane);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qreg[ks], QTile::frag_addr(sQ, q_lane, 16 * wl, ks * 16));
  }
}

// S = Q K^T for one warpgroup's 64 rows over a key tile of BK keys (KS k-steps of 16 dims): issued,
// not committed; the caller has zeroed s_flat and called wgmma_fence.  Q from registers (qreg, as
// wgmma_fwd_load_q leaves them) or, kQSmem, from shared memory at sQ (at d = 256, where O leaves no
// registers for Q); dK is the K tile's descriptor.
template <int BK, int KS, bool kQSmem, typename T, typename QTile, typename KVTile>
__device__ __forceinline__ void wgmma_fwd_issue_s(float (&s_flat)[BK / 2], const uint32_t (&qreg)[kQSmem ? 1 : KS][4],
                                                  uint32_t sQ, uint64_t dK) {
  if constexpr (kQSmem) {
    const uint64_t dQ = wgmma_desc(sQ, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      WgmmaSS<BK, 0, 0, T>::run(s_flat, wgmma_desc_advance(dQ, (ks >> 2) * QTile::kBlockBytes + (ks & 3) * 32),
                                wgmma_desc_advance(dK, (ks >> 2) * KVTile::kBlockBytes + (ks & 3) * 32));
  } else {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      WgmmaRS<BK, 0, T>::run(s_flat, qreg[ks], wgmma_desc_advance(dK, (ks >> 2) * KVTile::kBlockBytes + (ks & 3) * 32));
  }
}

// The tile-mask row of the decision tile (`rows` rows from row0: a warp pair's 32, or one warp's
// 16) when the caller records decisions, with its tiles past last_tile (its newest legal one) marked
// illegal (the warp's 32 lanes write them); nullptr otherwise.
__device__ __forceinline__ uint8_t* wgmma_fwd_mask_row(const FwdParams& p, int b, int h, int row0, int rows,
                                                       int last_tile, int lane) {
  const int qt = row0 / rows;
  if (p.tile_mask == nullptr || qt >= p.n_q_tiles_mask) return nullptr;
  uint8_t* mask_row = p.tile_mask + (((int64_t)b * p.heads_q + h) * p.n_q_tiles_mask + qt) * p.n_k_tiles_mask;
  for (int kt = last_tile + 1 + lane; kt < p.n_k_tiles_mask; kt += 32) mask_row[kt] = kTileIllegal;
  return mask_row;
}

// The first half of a warp's part of the decision on its 16 rows of a key tile starting at key k0,
// whose scores are in s (the wgmma kernel, one m16 block per warp; the test against a raw bound is
// the caller's): the causal/bounds mask where the tile reaches past the warp's shortest row (min_L_w
// keys) and each lane's part of the row max into mx.  The test is monotone in tile_max, so a row
// passes iff every lane's part does, and the warp's vote over the parts is the vote over the rows,
// bit for bit.
template <int NT>
__device__ __forceinline__ void warp_mask_max(float (&s)[1][NT][4], float (&mx)[1][2], int k0, int min_L_w,
                                              int row_w, int lane, int Nq, int Nk, bool causal) {
  if (k0 + 8 * NT > min_L_w) {
    int lim[1][2];
    row_limits<1>(lim, row_w, lane, Nq, Nk, causal);
    apply_mask<1, NT>(s, lim, k0, lane);
  }
  lane_row_max<1, NT>(s, 0, mx[0][0], mx[0][1]);
}

}  // namespace cuda
}  // namespace mala

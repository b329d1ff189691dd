// dQ at head dim 256 on Hopper (wgmma + TMA), sm_90a: the query-major half of the d = 256 backward.
// The key-major kernel (sm90_256_kernel.cuh) computes dK and dV and decides every tile; adding its
// dQ partials into an fp32 accumulator took longer than all its other work (64 KB of L2 adds per
// 64 x 64 tile).
// This kernel recomputes S and dP per query tile instead and keeps dQ in registers: two GEMMs more
// than one kernel would run, no atomics, dQ written once in the output dtype, and the same bits in
// every run (deterministic by construction).  The decisions are the key-major kernel's, read from the
// tile mask it recorded (tau > 0), so both halves of the gradient skip exactly the same tiles.
//
// One CTA per (128 query rows, query head, sequence); three warpgroups:
//   producer (warpgroup 0, 24 registers; one thread issues every TMA load, bwd256_dq_load in
//     bwd/sm90_256_producer.cuh; BwdDq256: bwd/sm90_256_traits.cuh): Q and dO of the CTA's rows
//     once, then K_t and V_t of each 32-key step that one of the CTA's four decision tiles retains
//     (read from the tile mask, 8 steps at a time) into rings of 2 slots (full / empty mbarriers),
//     with the step and its four decisions in a word beside the slot; a word of -1 ends the loop.
//   consumers (warpgroups 1 and 2, 240 registers, 64 rows each), per key step t:
//     S = Q K_t^T, dP = dO V_t^T (ss m64n32k256), mask, P = exp2(S - lse) (0 on the rows of a skipped
//     32 x 64 decision tile), dS = P (dP - D), dQ += dS K_t (rs m64n256k32, dS from registers);
//     a step whose two decision tiles (the warpgroup's two 32-row halves) are both skipped issues
//     nothing, and one that the whole CTA skips is not even loaded.  dQ's product is left in flight
//     under the next step's S and dP.
#pragma once

#include <stddef.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_256_producer.cuh"
#include "cuda/bwd/sm90_256_traits.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/tma.cuh"
#include "cuda/core/wgmma.cuh"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

template <typename T, bool kDense>
__global__ void __launch_bounds__(384, 1)
    bwd_dq_kernel_sm90_ws256(const BwdParams p, const __grid_constant__ BwdTmaMaps maps) {
#ifdef MALA_WGMMA_ENABLED
  using C = BwdDq256;
  constexpr int D = C::D, BQ = C::BQ, BKS = C::BKS, NS = C::kStages;
  using QTile = typename C::QTile;
  using KTile = typename C::KTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int qtile = longest_first_query_tile(p.causal);
  const bool varlen = p.cu_q != nullptr;
  const int64_t qrow0 = varlen ? p.cu_q[b] : static_cast<int64_t>(b) * p.seqlen_q;
  const int64_t krow0 = varlen ? p.cu_k[b] : static_cast<int64_t>(b) * p.seqlen_k;
  const int qlen = varlen ? p.cu_q[b + 1] - p.cu_q[b] : p.seqlen_q;
  const int klen = varlen ? p.cu_k[b + 1] - p.cu_k[b] : p.seqlen_k;
  const int row_cta = qtile * BQ;
  if (row_cta >= qlen) return;
  auto keys_seen = [&](int r0, int rows) {  // keys visible to the last of rows r0 .. r0 + rows - 1
    const int last = min(r0 + rows, qlen) - 1;
    return last >= r0 ? rule::visible_keys(last, qlen, klen, p.causal) : 0;
  };
  const int n_steps = rule::ceil_div(keys_seen(row_cta, BQ), BKS);
  const int hk = h / p.group;
  const int q_map_row = varlen ? static_cast<int>(qrow0) : 0, k_map_row = varlen ? static_cast<int>(krow0) : 0;
  const int map_b = varlen ? 0 : b;

  using Sm = typename C::Storage;
  Sm& st = *reinterpret_cast<Sm*>(smem);
  const uint32_t sQ = sbase + offsetof(Sm, q), sDO = sbase + offsetof(Sm, dout), sK = sbase + offsetof(Sm, k),
                 sV = sbase + offsetof(Sm, v);
  const uint32_t mb_qdo = sbase + offsetof(Sm, qdo_bar);
  const MbarRing<NS> kring = MbarRing<NS>::at(sbase + offsetof(Sm, k_bar));
  const MbarRing<NS> vring = MbarRing<NS>::at(sbase + offsetof(Sm, v_bar));
  if (tid == 0) {
    mbar_init(mb_qdo, 1);
    // Slot by slot, both rings side by side (the order of the inits reaches the PTX): the producer's
    // expect_tx arrival; one arrival per consumer warp.
    for (int i = 0; i < NS; ++i) {
      kring.init_slot(i, 1, 8);
      vring.init_slot(i, 1, 8);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (tid < 128) {
    setmaxnreg_dec24();
    if (tid == 0)
      bwd256_dq_load<kDense>(p, maps, st, kring, vring, mb_qdo, sQ, sDO, sK, sV, h, b, hk, row_cta, n_steps,
                             q_map_row, k_map_row, map_b);
    return;
  }

  setmaxnreg_inc240();
  const int ctid = tid - 128, warp = __shfl_sync(0xffffffffu, ctid >> 5, 0), lane = ctid & 31, wg = warp >> 2,
            wl = warp & 3, gid = lane >> 2, tig = lane & 3;
  const int row_wg = row_cta + 64 * wg;
  const int r_lo = row_wg + 16 * wl + gid;  // this thread's rows: r_lo, r_lo + 8
  // The warpgroup's last step with a visible key (steps after it are fully masked for its rows).
  const int wg_steps = rule::ceil_div(keys_seen(row_wg, 64), BKS);
  float lse[2], dsum[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = r_lo + 8 * hh;
    const int64_t at = static_cast<int64_t>(h) * p.rows_q_cap + qrow0 + min(r, qlen - 1);
    lse[hh] = p.lse2[at];
    dsum[hh] = p.dsum[at];
  }
  const int half = wl >> 1;  // this warp's rows are half `half` of the warpgroup's
  const int* step_word = st.step;
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
  wgmma_fence_operands(dq);
  float s[16], dp[16];
  mbar_wait<true>(mb_qdo, 0);
  const uint32_t sQg = sQ + wg * QTile::kBytes, sDOg = sDO + wg * QTile::kBytes;
  int pending_k = -1;  // the slot whose K goes back once its dQ product has completed
  for (int u = 0;; ++u) {
    const int ks = u & 1;
    kring.consumer_wait(RingPos{ks, bwd_ws_parity(u >> 1)});
    // Read by the lane that gives the slot back (so the read is ordered before that arrival).
    const int word = __shfl_sync(0xffffffffu, lane == 0 ? step_word[ks] : 0, 0);
    if (word < 0) break;
    const int t = word >> 4;
    const bool kept0 = (word >> (2 * wg)) & 1, kept1 = (word >> (2 * wg + 1)) & 1;
    const bool work = t < wg_steps && (kept0 || kept1);
    vring.consumer_wait(RingPos{ks, bwd_ws_parity(u >> 1)});
    if (work) {
#pragma unroll
      for (int e = 0; e < 16; ++e) s[e] = dp[e] = 0.f;
      wgmma_fence_operands(s);
      wgmma_fence_operands(dp);
      wgmma_fence();
      wgmma_ss_kmajor<BKS, D, T>(s, sQg, QTile::kBlockBytes, sK + ks * KTile::kBytes, KTile::kBlockBytes);
      wgmma_ss_kmajor<BKS, D, T>(dp, sDOg, QTile::kBlockBytes, sV + ks * KTile::kBytes, KTile::kBlockBytes);
      wgmma_commit();
      wgmma_wait<0>();  // S, dP, and the previous step's dQ product
      wgmma_fence_operands(s);
      wgmma_fence_operands(dp);
      wgmma_fence_operands(dq);
    }
    if (pending_k >= 0) {
      if (!work) wgmma_wait<0>();  // (on the work path the wait above covered it)
      if (lane == 0) kring.release(pending_k);  // the last dQ product has read its K
      pending_k = -1;
    }
    if (lane == 0) vring.release(ks);  // dP has read V_t (or nothing will)
    if (!work) {
      if (lane == 0) kring.release(ks);
      continue;
    }
    // Entry 4n + 2hh + c: row r_lo + 8hh, key 32t + 8n + 2tig + c.
    const bool kept_rows = half ? kept1 : kept0;
    const int k0 = t * BKS;
    uint32_t da[2][4];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = r_lo + 8 * hh;
      const int L = r < qlen ? rule::visible_keys(r, qlen, klen, p.causal) : 0;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        float v[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 4 * n + 2 * hh + c;
          const bool live = kept_rows && k0 + 8 * n + 2 * tig + c < L;
          const float pr = live ? exp2f(s[e] * p.scale_log2 - lse[hh]) : 0.f;
          v[c] = pr * (dp[e] - dsum[hh]);
        }
        // A fragment of k16 block n / 2: a0 (row g, keys 2tig..) a1 (row g + 8) a2 / a3 (keys + 8).
        da[n >> 1][(n & 1) * 2 + hh] = pack2<T>(v[0], v[1]);
      }
    }
    wgmma_fence();
    const uint32_t bk = sK + ks * KTile::kBytes;
#pragma unroll
    for (int kk = 0; kk < BKS / 16; ++kk) WgmmaRS<D, 1, T>::run(dq, da[kk], wgmma_desc(bk + kk * 2048, KTile::kBlockBytes, 1024));
    wgmma_commit();
    pending_k = ks;
  }
  wgmma_wait<0>();
  wgmma_fence_operands(dq);
  if (pending_k >= 0 && lane == 0) kring.release(pending_k);

  // dQ (scaled) into the output: element 4n + 2hh + c is row r_lo + 8hh, column 8n + 2tig + c.
  const int64_t dq_b = varlen ? 0 : static_cast<int64_t>(b) * p.dq_b;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = r_lo + 8 * hh;
    if (r >= qlen) continue;
    T* out = static_cast<T*>(p.dq) + dq_b + (varlen ? qrow0 + r : r) * p.dq_r + static_cast<int64_t>(h) * p.dq_h + 2 * tig;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + 8 * n) = pack2<T>(dq[4 * n + 2 * hh] * p.scale, dq[4 * n + 2 * hh + 1] * p.scale);
  }
#endif
}

}  // namespace cuda
}  // namespace mala

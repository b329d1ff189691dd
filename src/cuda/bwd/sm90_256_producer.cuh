// The d = 256 backward's loads: warpgroup 0 of each kernel (24 registers), one thread a loader
// issuing its TMA loads.
//   key-major kernel (bwd/sm90_256_kernel.cuh), warp 0 (bwd256_load_q): K and V once, then Q_t with
//     its rows' lse and skip bound into the Q ring (BwdWs256::kStages slots); warp 1
//     (bwd256_load_do): dO_t with D = rowsum(dO * O) into the dO ring, every tile (the consumers
//     issue S^T and dP^T together, before the test).  Before refilling a slot each waits through
//     MbarRing::producer_wait at the RingPos of the new use.
//   dQ kernel (bwd/sm90_256_dq_kernel.cuh), thread 0 (bwd256_dq_load): Q and dO of the CTA's rows
//     once, then K_t and V_t of each retained 32-key step into the K and V rings.
// What the kernel computed comes by reference (the role functions of the forward say why:
// fwd/sm90_consumer.cuh): q_row0, k_row0, map_b: the TMA coordinates of the sequence's row 0.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_256_traits.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/tma.cuh"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

// Key-major kernel, one thread of warp 0: K and V into their one slot each (mbarrier mb_kv), then
// Q_t and its rows' scalars into the Q ring, every tile.
template <bool kDense>
__device__ __forceinline__ void bwd256_load_q(const BwdParams& p, const BwdTmaMaps& maps, const BwdWork& w,
                                              const int& n_iter, const int& kb,
                                              const MbarRing<BwdWs256::kStages>& qring, const uint32_t& mb_kv,
                                              const uint32_t& sbase, const uint32_t& sK, const uint32_t& sV,
                                              const uint32_t& sQ, const int& q_row0, const int& k_row0,
                                              const int& map_b) {
  using C = BwdWs256;
  constexpr int D = C::D, BQ = C::BQ, BK = C::BK, NS = C::kStages;
  using QTile = typename C::QTile;
  using Sm = typename C::Storage;
  tma_load_tile<BK, D>(sK, &maps.k, mb_kv, k_row0 + kb, w.hk, map_b);
  tma_load_tile<BK, D>(sV, &maps.v, mb_kv, k_row0 + kb, w.hk, map_b);
  BwdWork::Tile x = w.tile(0);
  for (int t = 0; t < n_iter; ++t, x = w.next(x)) {
    const int s = t & 1;
    if (t >= NS) qring.producer_wait(RingPos{s, bwd_ws_parity(t >> 1)});
    const int at = C::vec_at(p, w, x);
    const uint32_t full = qring.full(s);
    mbar_arrive_expect_tx(full, QTile::kBytes + (kDense ? 1 : 2) * C::kVec * 4);
    tma_load_tile_boxes<BQ, D>(sQ + s * QTile::kBytes, &maps.q, full, q_row0 + x.qi() * BQ, x.h(), map_b);
    tma_load_1d(sbase + offsetof(Sm, lse) + s * C::kVecStride * 4, &maps.lse, full, at & ~3);
    if (!kDense) tma_load_1d(sbase + offsetof(Sm, bound) + s * C::kVecStride * 4, &maps.bound, full, at & ~3);
  }
}

// Key-major kernel, one thread of warp 1: dO_t and its rows' D into the dO ring, every tile.
__device__ __forceinline__ void bwd256_load_do(const BwdParams& p, const BwdTmaMaps& maps, const BwdWork& w,
                                               const int& n_iter, const MbarRing<BwdWs256::kStages>& doring,
                                               const uint32_t& sbase, const uint32_t& sDO, const int& q_row0,
                                               const int& map_b) {
  using C = BwdWs256;
  constexpr int D = C::D, BQ = C::BQ, NS = C::kStages;
  using QTile = typename C::QTile;
  using Sm = typename C::Storage;
  BwdWork::Tile x = w.tile(0);
  for (int t = 0; t < n_iter; ++t, x = w.next(x)) {
    const int s = t & 1;
    if (t >= NS) doring.producer_wait(RingPos{s, bwd_ws_parity(t >> 1)});
    const uint32_t full = doring.full(s);
    mbar_arrive_expect_tx(full, QTile::kBytes + C::kVec * 4);
    tma_load_tile_boxes<BQ, D>(sDO + s * QTile::kBytes, &maps.dout, full, q_row0 + x.qi() * BQ, x.h(), map_b);
    tma_load_1d(sbase + offsetof(Sm, dsum) + s * C::kVecStride * 4, &maps.dsum, full, C::vec_at(p, w, x) & ~3);
  }
}

// dQ kernel, thread 0: Q and dO of the CTA's rows once (mbarrier mb_qdo), then K_t and V_t of each
// 32-key step that one of the CTA's four decision tiles retains into the K and V rings, with the
// step and its decisions in the slot's word (BwdDq256::Storage::step); a word of -1 ends the loop.
// Its ring waits stay by hand: producer_wait (the parity of the new use, flipped) changed the SASS.
template <bool kDense>
__device__ __forceinline__ void bwd256_dq_load(const BwdParams& p, const BwdTmaMaps& maps,
                                               typename BwdDq256::Storage& st,
                                               const MbarRing<BwdDq256::kStages>& kring,
                                               const MbarRing<BwdDq256::kStages>& vring, const uint32_t& mb_qdo,
                                               const uint32_t& sQ, const uint32_t& sDO, const uint32_t& sK,
                                               const uint32_t& sV, const int& h, const int& b, const int& hk,
                                               const int& row_cta, const int& n_steps, const int& q_map_row,
                                               const int& k_map_row, const int& map_b) {
  using C = BwdDq256;
  constexpr int D = C::D, BKS = C::BKS, NS = C::kStages;
  using QTile = typename C::QTile;
  using KTile = typename C::KTile;
  mbar_arrive_expect_tx(mb_qdo, 4 * QTile::kBytes);
  for (int g = 0; g < 2; ++g) {
    tma_load_tile_boxes<64, D>(sQ + g * QTile::kBytes, &maps.q, mb_qdo, q_map_row + row_cta + 64 * g, h, map_b);
    tma_load_tile_boxes<64, D>(sDO + g * QTile::kBytes, &maps.dout, mb_qdo, q_map_row + row_cta + 64 * g, h, map_b);
  }
  // The CTA's four 32-row decision tiles (halves k = 0..3 of its rows; warpgroup g has 2g, 2g + 1)
  // of 64-key tile j: bit k set when half k retains it (every bit at tau = 0).
  const int i0 = row_cta / C::BH;
  auto halves = [&](int j) -> uint32_t {
    if (kDense) return 0xFu;
    uint32_t bits = 0;
    const uint8_t* m = p.tile_mask + ((static_cast<int64_t>(b) * p.heads_q + h) * p.n_q_tiles + i0) * p.n_k_tiles + j;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (i0 + k < p.n_q_tiles && m[static_cast<int64_t>(k) * p.n_k_tiles] == mala::kTileRetained) bits |= 1u << k;
    return bits;
  };
  int* step_word = st.step;
  int u = 0;  // loaded steps so far: the rings' use count
  auto next_slot = [&]() {
    const int s = u & 1;
    if (u >= NS) {  // by hand: producer_wait (the parity of the new use, flipped) changed the SASS
      mbar_wait<true>(kring.empty(s), bwd_ws_parity((u >> 1) - 1));
      mbar_wait<true>(vring.empty(s), bwd_ws_parity((u >> 1) - 1));
    }
    return s;
  };
  constexpr int kAhead = 4;  // 64-key tiles whose decisions are read at once (their loads overlap)
  for (int j0 = 0; 2 * j0 < n_steps; j0 += kAhead) {
    uint32_t bits[kAhead];
#pragma unroll
    for (int jj = 0; jj < kAhead; ++jj) bits[jj] = 2 * (j0 + jj) < n_steps ? halves(j0 + jj) : 0u;
#pragma unroll
    for (int jj = 0; jj < kAhead; ++jj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = 2 * (j0 + jj) + e;
        if (t >= n_steps || bits[jj] == 0u) continue;
        const int s = next_slot();
        step_word[s] = (t << 4) | static_cast<int>(bits[jj]);
        tma_load_tile<BKS, D>(sK + s * KTile::kBytes, &maps.k32, kring.full(s), k_map_row + t * BKS, hk, map_b);
        tma_load_tile<BKS, D>(sV + s * KTile::kBytes, &maps.v32, vring.full(s), k_map_row + t * BKS, hk, map_b);
        ++u;
      }
  }
  const int s = next_slot();
  step_word[s] = -1;  // the end: a phase of the K slot's full barrier without bytes
  kring.fill_empty(s);
}

}  // namespace cuda
}  // namespace mala

// The d = 256 key-major backward's loads (bwd/sm90_256_kernel.cuh): warps 0 and 1 of the producer
// warpgroup (24 registers), one thread of each issuing its TMA loads.
//   warp 0 (bwd256_load_q): K and V once, then Q_t with its rows' lse and skip bound into the Q ring
//     (BwdWs256::kStages slots);
//   warp 1 (bwd256_load_do): dO_t with D = rowsum(dO * O) into the dO ring, every tile (the
//     consumers issue S^T and dP^T together, before the test).
// Before refilling a slot each waits through MbarRing::producer_wait at the RingPos of the new use.
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

}  // namespace cuda
}  // namespace mala

// The warp-specialized backward's loads (bwd/sm90_kernel.cuh): warps 0 and 1 of the producer
// warpgroup (24 registers), one thread of each issuing its TMA loads.
//   warp 0 (bwd_sm90_load_q): K and V once, then Q_t with its rows' lse, skip bound (and in the
//     deterministic mode the rows' dQ units) into the Q ring (BwdWs::kQStages slots);
//   warp 1 (bwd_sm90_load_do): dO_t with D = rowsum(dO * O) into the dO ring of 2 slots:
//     speculatively when tile t - 2 was retained (always at tau = 0), else once the consumers have
//     decided tile t, and only if they retain it.  The slot's full barrier completes once per tile
//     either way (with no bytes when dO_t is not loaded), so every phase is static.
// With kFwdMask both skip the tiles the forward's mask leaves unscored (is_scored), so their rings
// count scored tiles only, as the consumers' do.  Before refilling a slot each waits through
// MbarRing::producer_wait at the RingPos of the new use (the slot, the use's parity), from counters
// the loop steps itself: a RingPos stepped by advance (with a flag for the first pass) changed the
// SASS of all six instances.
// What the kernel computed comes by reference (the role functions of the forward say why:
// fwd/sm90_consumer.cuh): q_row0, k_row0, map_b: the TMA coordinates of the sequence's row 0.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/tma.cuh"

namespace mala {
namespace cuda {

// Warp 0: K and V into their one slot each (mbarrier mb_kv), then Q_t and its rows' scalars into
// the Q ring for every scored tile.
template <int D, bool kDense, bool kFwdMask, bool kDet, typename Scored>
__device__ __forceinline__ void bwd_sm90_load_q(const BwdParams& p, const BwdTmaMaps& maps, const BwdWork& w,
                                                const int& lane, const int& n_iter, const int& kb,
                                                const Scored& is_scored,
                                                const MbarRing<BwdWs<D, kDet>::kQStages>& qring, const uint32_t& mb_kv,
                                                const uint32_t& sbase, const uint32_t& sK, const uint32_t& sV,
                                                const uint32_t& sQ, const int& q_row0, const int& k_row0,
                                                const int& map_b) {
  using C = BwdWs<D, kDet>;
  constexpr int BQ = C::BQ, BK = C::BK, NQS = C::kQStages;
  using QTile = typename C::QTile;
  using Sm = typename C::Storage;
  if (lane == 0) {
    tma_load_tile<BK, D>(sK, &maps.k, mb_kv, k_row0 + kb, w.hk, map_b);
    tma_load_tile<BK, D>(sV, &maps.v, mb_kv, k_row0 + kb, w.hk, map_b);
  }
  BwdWork::Tile x = w.tile(0);
  for (int t = 0, s = 0, use = 0; t < n_iter; ++t, x = w.next(x)) {
    if constexpr (kFwdMask)
      if (!is_scored(t)) continue;
    if (use > 0) qring.producer_wait(RingPos{s, bwd_ws_parity(use)});
    // Q, and lse and the bound of its rows (rows past the sequence read the next rows' finite
    // values: their scores are masked, so P is 0 and no bound is reached).
    if (lane == 0) {
      const int h = x.h(), r0 = x.qi() * BQ, at = static_cast<int>(h * p.rows_q_cap + w.qrow0 + r0);
      const uint32_t full = qring.full(s);
      mbar_arrive_expect_tx(full, QTile::kBytes + ((kDense ? 1 : 2) + (kDet ? 1 : 0)) * C::kVec * 4);
      tma_load_tile_boxes<BQ, D>(sQ + s * QTile::kBytes, &maps.q, full, q_row0 + r0, h, map_b);
      tma_load_1d(sbase + offsetof(Sm, lse) + s * C::kVecStride * 4, &maps.lse, full, at & ~3);
      if (!kDense) tma_load_1d(sbase + offsetof(Sm, bound) + s * C::kVecStride * 4, &maps.bound, full, at & ~3);
      if (kDet) tma_load_1d(sbase + offsetof(Sm, unit) + s * C::kVecStride * 4, &maps.unit, full, at & ~3);
    }
    if (++s == NQS) {
      s = 0;
      ++use;
    }
  }
}

// Warp 1: dO_t and its rows' D into the dO ring for every scored tile, reading the consumers'
// decisions (mb_dec, s_dec: the decision slots, BwdWs::Storage::dec) where the load waits for one.
template <int D, bool kDense, bool kFwdMask, bool kDet, typename Scored>
__device__ __forceinline__ void bwd_sm90_load_do(const BwdParams& p, const BwdTmaMaps& maps, const BwdWork& w,
                                                 const int& lane, const int& n_iter, const Scored& is_scored,
                                                 const MbarRing<2>& doring, const uint32_t& mb_dec,
                                                 volatile int* const& s_dec, const uint32_t& sbase,
                                                 const uint32_t& sDO, const int& q_row0, const int& map_b) {
  using C = BwdWs<D, kDet>;
  constexpr int BQ = C::BQ;
  using QTile = typename C::QTile;
  using Sm = typename C::Storage;
  // Tile t's decision, (t << 1) | retained, once the consumers have published it.  (Slot t % 8 is
  // not reused before this warp has read it: the consumers give back every tile's dO slot, so they
  // run at most a few tiles ahead of this warp.)
  auto decision = [&](int t) {
    mbar_wait<true>(mb_dec + 8 * (t & 7), bwd_ws_parity(t >> 3));
    return s_dec[t & 7];
  };
  // The rings count scored tiles only (r: u with kFwdMask, else t).
  BwdWork::Tile x = w.tile(0);
  for (int t = 0, u = 0; t < n_iter; ++t, x = w.next(x)) {
    if constexpr (kFwdMask)
      if (!is_scored(t)) continue;
    const int r = kFwdMask ? u++ : t;
    const int s = r & 1;
    if (r >= 2) doring.producer_wait(RingPos{s, bwd_ws_parity(r >> 1)});
    bool load = true;
    // Speculative when tile r - 2 was retained: its decision is out by the time its dO slot (this
    // one) comes back, so the load is not held up by tile r - 1's.
    if (!kDense && r > 1 && (decision(r - 2) & 1) == 0) load = (decision(r) & 1) != 0;
    if (lane == 0) {
      const uint32_t full = doring.full(s);
      if (load) {
        const int h = x.h(), r0 = x.qi() * BQ, at = static_cast<int>(h * p.rows_q_cap + w.qrow0 + r0);
        mbar_arrive_expect_tx(full, QTile::kBytes + C::kVec * 4);
        tma_load_tile_boxes<BQ, D>(sDO + s * QTile::kBytes, &maps.dout, full, q_row0 + r0, h, map_b);
        tma_load_1d(sbase + offsetof(Sm, dsum) + s * C::kVecStride * 4, &maps.dsum, full, at & ~3);
      } else {
        doring.fill_empty(s);  // no dO: the phase completes without bytes
      }
    }
  }
}

}  // namespace cuda
}  // namespace mala

// The sm_90 forward's consumers (fwd/sm90_kernel.cuh): warpgroups 1 and 2, 240 registers, 64 query
// rows each; Q in registers, at d = 256 in shared memory.  Per key tile, from the diagonal down,
//   issue S(t - 1) = Q K(t - 1)^T; at d = 128 the warpgroup's vote on tile t (one bar.red.or, whose
//     wait overlaps S(t - 1)); where the warpgroup runs tile t, O += P(t) V(t) (P(t) packed in
//     registers, 0 for a warp or pair that skips it);
//   once S(t - 1) is complete: mask, row max, at tau > 0 the test (each lane's part of the raw row
//     max against a bound per row) and the vote (d = 128: the warp's own, so nothing waits for
//     another warp before the exponentials; otherwise the pair vote, one bar.red.popc per
//     warpgroup), then, where the warp (pair vote: the warpgroup) runs the tile,
//     P(t - 1) = exp2(S - m) with the lazy rescale's base (its exponentials run while P V(t) is on
//     the tensor cores);
//   once P V(t) is complete: O rescaled where a row's base moved, P(t - 1) packed.
// One S accumulator and one packed P per thread (64 + 32 registers at 128 keys) instead of two S
// accumulators: what lets 128-key tiles fit beside O and Q.
//
// The steps of a tile (issue_s, s_done, scores, issue_pv, pv_done, settle, pack_p, publish) are
// lambdas over the function's locals.  Written as functions taking those locals explicitly (by
// value or by reference), and with the locals in structs, the same steps changed the PTX's phi
// order for the ring positions kr and vr (SROA promotes the locals in another order once no
// closure holds their addresses) and the SASS of 4 of the 15 instances (docs/journal.md).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/core/pipeline.cuh"
#include "cuda/core/wgmma.cuh"
#include "cuda/fwd/common.cuh"
#include "cuda/fwd/sm90_epilogue.cuh"
#include "cuda/fwd/sm90_traits.cuh"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

// A consumer thread's whole run (tid: its thread in the CTA, >= 128): who it is, the test's inputs,
// O = 0 and Q, then every key tile from `top` down, then the epilogue (fwd/sm90_epilogue.cuh).  The
// template flags are the kernel's, in its order (fwd/sm90_kernel.cuh).  What the kernel computed
// comes by reference, scalars included: copied into this function's own locals, the values the
// steps capture move the phi nodes of kr and vr, which changed the SASS of one instance.
//   row_cta: the CTA's first row; top: its newest key tile; kring, vring: the K and V rings
//   (k_mbar: the K ring's full0, see issue_s); sK0, sV0, sQ0: the rings' and the Q tiles' first
//   slots; sbase: the shared base, from which publish builds the decision ring (FwdK128::dec_ring):
//   the ring itself by reference moved the phi nodes of kr and vr, which changed the SASS of one
//   instance.
template <typename T, int D, bool kDense, bool kSeeded, bool kRecord>
__device__ __forceinline__ void fwd_sm90_consume(const FwdParams& p, const FwdSeq<T>& sq, const int& Nq,
                                                 const int& Nk, const int& b, const int& h, const int& tid,
                                                 const int& row_cta, const int& top,
                                                 const MbarRing<FwdK128<D>::kStages>& kring,
                                                 const MbarRing<FwdK128<D>::kStages>& vring, const uint32_t& sK0,
                                                 const uint32_t& sV0, const uint32_t& sQ0, const uint32_t& sbase,
                                                 const uint32_t& k_mbar) {
  using C = FwdK128<D>;
  constexpr int BK = C::BK, NT = BK / 8, DT = D / 8, KS = D / 16, NS = C::kStages;
  using QTile = typename C::QTile;
  using KVTile = typename C::KVTile;
  setmaxnreg_inc240();
  // The warp index through a shuffle, so that ptxas knows what derives from it to be warp-uniform.
  const int ctid = tid - 128, warp = __shfl_sync(0xffffffffu, ctid >> 5, 0), lane = ctid & 31, wg = warp >> 2,
            wl = warp & 3, pair = wl >> 1;
  const int row_wg = row_cta + 64 * wg;
  const int row_w = row_wg + 16 * wl;
  // The first row of this warp's decision tile (its own rows where kWarpVote, else its pair's).
  const int row_dec = C::kWarpVote ? row_w : row_wg + C::kDecRows * pair;
  // This warpgroup's first tile; the tiles above it (only where its rows end before the CTA's last
  // row sees them) are passed through the rings untouched.  dec_hi: the decision tile's newest legal
  // tile.
  const int wg_hi = sq.last_tile(row_wg, 64, BK, p.causal);
  const int dec_hi = sq.last_tile(row_dec, C::kDecRows, BK, p.causal);
  const int min_L_w = row_w + 16 <= Nq ? rule::visible_keys(row_w, Nq, Nk, p.causal) : 0;
  // The test compares each lane's part of the raw row max with a bound per row (rule::skip_bound_raw),
  // recomputed after each tile the warp retains: one comparison per row before the vote.
  float log_thr[1][2], bound[1][2];
  const float inv_scale = 1.f / p.scale_log2;
  FwdAnchors anchors{false, 1, 0};
  if constexpr (!kDense) {
    float log_norm[1][2];
    wgmma_fwd_test_inputs(log_thr, log_norm, b, h, row_w, lane, Nq, Nk, p);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) bound[0][hh] = rule::skip_bound_raw(log_norm[0][hh], log_thr[0][hh], inv_scale);
    if constexpr (kSeeded) anchors = fwd_held_anchors<BK>(p, row_dec, dec_hi, Nq, Nk);
  }
  // Pair vote (skip.cuh, pair_vote_popc): every lane of a retaining pair-0 warp counts, lane 0
  // of a retaining pair-1 warp.
  const uint32_t vote_counted = wl < 2 || lane == 0;
  // One warp per decision tile stores its decisions.
  uint8_t* mask_row = kRecord && (C::kWarpVote || wl % 2 == 0)
                          ? wgmma_fwd_mask_row(p, b, h, row_dec, C::kDecRows, dec_hi, lane)
                          : nullptr;
  float m[1][2], l[1][2], acc[1][DT][4];
  softmax_init<1, DT>(m, l, acc);
  // tau > 0: this lane's parts of the last retained tile's row sums, not yet in l (settle, below).
  float part[1][2] = {{0.f, 0.f}};
  float(&acc_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&acc[0][0][0]);
  wgmma_fence_operands(acc_flat);  // O's zeros before the first wgmma (else ptxas sinks them: C7515)
  const uint32_t sQ = sQ0 + wg * QTile::kBytes;
  uint32_t qreg[C::kQSmem ? 1 : KS][4];
  wgmma_fwd_load_q<QTile, KS, !C::kQSmem>(sQ, sq, p, row_wg, wg, wl, lane, qreg);
  using SFlat = float[BK / 2];
  float s[1][NT][4], mx[1][2];
  SFlat& s_flat = *reinterpret_cast<SFlat*>(&s[0][0][0]);
  uint32_t pa[BK / 16][4];
  RingPos kr{0, 0u}, vr{0, 0u};
  // tau > 0: whether this warp (kWarpVote: lane 0 of each warp) or this warpgroup (its thread 0)
  // runs tile t, for the producer, published once S(t) is decided and before V(t) is waited for.
  // A predicate of DecisionRing::publish's PTX, not a branch.
  const uint32_t publisher = lane == 0 && (C::kWarpVote || wl == 0);
  const int pub_index = C::kWarpVote ? warp : wg;
  auto publish = [&](int t, bool retain) {
    if constexpr (!kDense && C::kVSkip)
      C::dec_ring(sbase).publish(static_cast<uint32_t>(top - t), publisher, pub_index, retain);
  };
  for (int t = top; t > wg_hi; --t) {  // tiles this warpgroup's rows do not reach
    kring.consumer_wait(kr);
    publish(t, false);  // nothing to compute; before V(t)'s wait, which may wait for this decision
    vring.consumer_wait(vr);
    if (lane == 0) {
      kring.consumer_release(kr);
      vring.consumer_release(vr);
    }
    kr.advance<NS>();
    vr.advance<NS>();
  }
  // S(t) = Q K(t)^T issued (not committed).
  auto issue_s = [&](int t) {
#pragma unroll
    for (int e = 0; e < BK / 2; ++e) s_flat[e] = 0.f;
    MbarRing<NS>::at(k_mbar).consumer_wait(kr);
    wgmma_fence();
    wgmma_fwd_issue_s<BK, KS, C::kQSmem, T, QTile, KVTile>(s_flat, qreg, sQ,
                                                           wgmma_desc(sK0 + kr.slot * KVTile::kBytes, 16, 1024));
  };
  // Once S(t) is complete: its K slot goes back.
  auto s_done = [&]() {
    wgmma_fence_operands(s_flat);
    if (lane == 0) kring.consumer_release(kr);
    kr.advance<NS>();
  };
  // O += P V(t) issued (not committed) where the warpgroup retains tile t; its V slot is waited for
  // either way, so that pv_done gives back a slot whose load has completed.
  auto issue_pv = [&](bool run) {
    vring.consumer_wait(vr);
    if (run) {
      wgmma_fence();
      const uint64_t dV = wgmma_desc(sV0 + vr.slot * KVTile::kBytes, KVTile::kBlockBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) WgmmaRS<D, 1, T>::run(acc_flat, pa[kk], wgmma_desc_advance(dV, kk * 2048));
    }
  };
  // tau > 0, once the next tile's wgmmas are issued where the warp retained the last tile: its
  // row sums into l (reduced over the quad) and the bound from the new m + log2 l, bit for bit what
  // the test would get were they computed right after the exponentials (softmax_step_deferred, kDeferSum),
  // but off the path from the exponentials to P V: the shuffles and lg2 wait behind the wgmmas.
  auto settle = [&]() {
    if constexpr (!kDense) {
      softmax_add_deferred_sum<1>(l, part);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        bound[0][hh] = fwd_row_bound<kSeeded>(p, b, h, row_w + (lane >> 2) + 8 * hh, Nq, m[0][hh], l[0][hh],
                                              log_thr[0][hh], inv_scale);
    }
  };
  auto pv_done = [&]() {
    wgmma_fence_operands(acc_flat);
    if (lane == 0) vring.consumer_release(vr);
    vr.advance<NS>();
  };
  // The complete S(t): mask, row max, (tau > 0) the test and the vote, and, where this warp runs
  // the tile (returned in `retain`, warp-uniform), P.  Returns true when O needs
  // softmax_rescale(alpha) first.
  //   kWarpVote: the warp's own vote; the warpgroup's (whether it runs P V) waits until the next S is
  //     issued (warpgroup_runs).
  //   Otherwise: the pair vote, whose count gives both pairs' decisions; the warpgroup runs the tile
  //     where either pair retains it (retain), and a skipping pair's rows get P = 0 and keep m and l.
  int retained = 0;
  auto scores = [&](int t, float(&alpha)[1][2], bool& retain) {
    warp_mask_max<NT>(s, mx, t * BK, min_L_w, row_w, lane, Nq, Nk, p.causal);
    if constexpr (kDense) {
      quad_row_max<1>(mx);
      retain = true;
      return softmax_step_deferred<1, NT, false>(s, mx, p.scale_log2, true, m, l, alpha);
    } else {
      bool lane_retain = lane_rows_block_skip_raw<1>(mx, bound);  // false for rows without legal keys
      if constexpr (kSeeded) lane_retain = lane_retain || (t <= dec_hi && fwd_forced_tile(anchors, t));
      bool dec_retain;
      if constexpr (C::kWarpVote) {
        retain = dec_retain = !warp_vote_skip(!lane_retain);
      } else {
        const uint32_t cnt = pair_vote_popc(wg + 1, 128, lane_retain, vote_counted);
        // (The quad reduction sits after the barrier in the source, but ptxas reads the barrier's
        // result right after issuing it, so the wait is not hidden: docs/kernels.md.)
        quad_row_max<1>(mx);
        dec_retain = (cnt & (pair ? 31u : ~31u)) != 0u;
        retain = __any_sync(0xffffffffu, cnt != 0u);  // warp-uniform for ptxas: no divergence handling
      }
      if (kRecord && mask_row && lane == 0 && t <= dec_hi) mask_row[t] = dec_retain ? kTileRetained : kTileSkipped;
      if (!retain) return false;
      if constexpr (C::kWarpVote) quad_row_max<1>(mx);  // only where the warp runs the tile
      if constexpr (kRecord) retained += dec_retain ? 1 : 0;
      // l and the bound: settle, once the next tile's wgmmas are issued.
      return softmax_step_deferred<1, NT, true, true>(s, mx, p.scale_log2, dec_retain, m, l, alpha, part);
    }
  };
  // Whether the warpgroup runs P V on the tile its warps decided (retain: this warp's decision), once
  // the next S is issued: the barrier's wait for the other warps then overlaps that product, where
  // the warps would meet anyway (none can go on before the tensor cores have S).
  // (Without kWarpVote, scores' retain is already the warpgroup's decision.)
  auto warpgroup_runs = [&](bool retain) {
    if constexpr (kDense || !C::kWarpVote)
      return retain;
    else
      return __any_sync(0xffffffffu, barrier_vote_or(wg + 1, 128, retain));  // warp-uniform for ptxas
  };
  // P for the next P V.  kWarpVote: a warp that skips the tile gives P = 0 (its m, l and O stay as
  // they were), in case its warpgroup runs the tile.  ptxas zeroes P ahead of the branch on every
  // tile (16 CS2R) and lets the pack overwrite it; zeroing behind a branch instead measured the same
  // (docs/kernels.md, "128-key forward", measured alternatives).
  auto pack_p = [&](bool retain) {
    if (retain) {
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) p_to_a<T, 1, NT>(s, 0, kk, pa[kk]);
    } else if constexpr (C::kWarpVote) {
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    }
  };
  if (wg_hi >= 0) {
    int t = wg_hi;
    issue_s(t);
    wgmma_commit();
    wgmma_wait<0>();
    s_done();
    bool retain;
    {
      float alpha[1][2];
      (void)scores(t, alpha, retain);  // O is still zero
      publish(t, retain);
      pack_p(retain);
    }
    for (; t > 0; --t) {
      issue_s(t - 1);
      wgmma_commit();
      const bool run = warpgroup_runs(retain);
      // No empty commit group for a skipped tile: ptxas closes one with a dummy wgmma placed after
      // the join, on both paths, and wait<1> then waits for P V(t) too (the exponentials below no
      // longer overlap it).
      issue_pv(run);
      if (run) {
        wgmma_commit();
        if (retain) settle();
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      s_done();
      float alpha[1][2];
      const bool rescale = scores(t - 1, alpha, retain);
      publish(t - 1, retain);
      wgmma_wait<0>();
      pv_done();
      if (rescale) softmax_rescale<1, DT>(alpha, acc);
      pack_p(retain);
    }
    const bool run = warpgroup_runs(retain);
    issue_pv(run);
    if (run) {
      wgmma_commit();
      if (retain) settle();  // l for the epilogue
    }
    wgmma_wait<0>();
    pv_done();
  }
  fwd_sm90_epilogue<T, D, kDense>(p, sq, b, h, row_w, lane, dec_hi, mask_row, retained, m, l, acc);
}

}  // namespace cuda
}  // namespace mala

// The warp-specialized backward's consumers (bwd/sm90_kernel.cuh): warpgroups 1 and 2, 240
// registers; warpgroup g owns keys 64g..64g+63 of the CTA's key tile.  Per scored tile:
//   S^T_g  = K_g Q^T                 (dP^T_g = V_g dO^T right behind it when dO_t is expected)
//   mask, offline test against each row's raw-score bound, CTA vote (tau > 0)
//   P^T = exp2(S^T - lse), dS^T = P^T (dP^T - D)      in registers
//   dS^T -> shared memory;  dV_g += P^T dO,  dK_g += dS^T Q    (A from registers)
//   both warpgroups' dS^T stored (named barrier): dQ[:, (D/2)g..] = dS K, then dK
//   (dQ goes to the writer while dK runs)
//   dQ -> shared memory (swizzled, conflict-free) for the writer (bwd/sm90_epilogue.cuh).
// A skipped tile stops after S^T: it releases its Q slot and issues no dP^T, dV, dK or dQ work.
// With the forward's tile mask (kFwdMask), a tile none of whose forward tiles was retained is
// skipped before S^T: no Q or dO load, no vote (the offline test would skip it: spec.md).
// After the last tile: dK and dV from registers (bwd/sm90_epilogue.cuh).
// The tile's arithmetic steps (S^T and dP^T, P^T, dS^T, the packing, the dS^T store, the dV, dQ and
// dK products) are functions below.  The decision and the rings' bookkeeping stay in the step lambda
// over bwd_sm90_consume's locals, as in the forward's consumers (fwd/sm90_consumer.cuh): moving the
// retained tile's work into a lambda of its own, or the prefetched tile's test and vote, changed the
// SASS of the d = 64 skipping instances (by a register swap for the vote alone).
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <type_traits>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_epilogue.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/wgmma.cuh"

namespace mala {
namespace cuda {

// The steps of a retained tile, on this thread's fragments of the warpgroup's m64 accumulators.
// Entry 4n + 2hh + c of S^T, dP^T, P^T, dS^T (64 keys x 64 query rows): key krow + 8hh, query row
// 8n + 2tig + c of the tile; lse_t, dsum_t: the tile's rows' scalars in their slots.

// acc (warpgroup wg's 64 keys x the tile's 64 rows) = X_wg Y^T over d, X = K or V (at sX), Y = Q or
// dO (at sY): S^T or dP^T; committed.
template <typename T, int D, typename KTile, typename QTile>
__device__ __forceinline__ void bwd_sm90_keys_x_rows(float (&acc)[32], const uint32_t& sX, const uint32_t& sY,
                                                     const int& wg) {
#pragma unroll
  for (int e = 0; e < 32; ++e) acc[e] = 0.f;
  wgmma_fence();
  wgmma_ss_kmajor<64, D, T>(acc, sX + 64 * wg * 128, KTile::kBlockBytes, sY, QTile::kBlockBytes);
  wgmma_commit();
}

// P^T = exp2(S^T * scale - lse), in place (S^T raw, masked entries -inf).
__device__ __forceinline__ void bwd_sm90_probs(float (&s)[32], const float* const& lse_t, const float& scale_log2,
                                               const int& tig) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float l2 = lse_t[n * 8 + 2 * tig + c];
      s[4 * n + c] = exp2f(s[4 * n + c] * scale_log2 - l2);
      s[4 * n + 2 + c] = exp2f(s[4 * n + 2 + c] * scale_log2 - l2);
    }
}

// dS^T = P^T (dP^T - D), in place of dP^T.
__device__ __forceinline__ void bwd_sm90_dscores(float (&dp)[32], const float (&s)[32], const float* const& dsum_t,
                                                 const int& tig) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float dd = dsum_t[n * 8 + 2 * tig + c];
      dp[4 * n + c] = s[4 * n + c] * (dp[4 * n + c] - dd);
      dp[4 * n + 2 + c] = s[4 * n + 2 + c] * (dp[4 * n + 2 + c] - dd);
    }
}

// P^T and dS^T packed into wgmma A fragments (T), one per 16 query rows: the operands of dV and dK.
template <typename T>
__device__ __forceinline__ void bwd_sm90_pack(const float (&s)[32], const float (&dp)[32], uint32_t (&pa)[4][4],
                                              uint32_t (&da)[4][4]) {
#pragma unroll
  for (int kq = 0; kq < 4; ++kq)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pa[kq][i] = pack2<T>(s[8 * kq + 2 * i], s[8 * kq + 2 * i + 1]);
      da[kq][i] = pack2<T>(dp[8 * kq + 2 * i], dp[8 * kq + 2 * i + 1]);
    }
}

// dS^T (packed) -> the dS^T tile in shared memory at dsb, for dQ = dS K.
template <typename STile>
__device__ __forceinline__ void bwd_sm90_store_ds(unsigned char* const& dsb, const uint32_t (&da)[4][4],
                                                  const int& krow, const int& tig) {
#pragma unroll
  for (int kq = 0; kq < 4; ++kq) {
    const int c = kq * 16 + 2 * tig;
    *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow, c)) = da[kq][0];
    *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow + 8, c)) = da[kq][1];
    *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow, c + 8)) = da[kq][2];
    *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow + 8, c + 8)) = da[kq][3];
  }
}

// acc (m64nD, this warpgroup's keys) += A^T Y, A: P^T or dS^T from registers, Y: the tile's dO or Q
// (at sY, QTile's layout); issued, not committed.  dV += P^T dO and dK += dS^T Q.
template <typename T, int D, typename QTile>
__device__ __forceinline__ void bwd_sm90_issue_rows_x_d(float (&acc)[D / 2], const uint32_t (&a)[4][4],
                                                        const uint32_t& sY) {
#pragma unroll
  for (int kq = 0; kq < 4; ++kq)
    WgmmaRS<D, 1, T>::run(acc, a[kq], wgmma_desc(sY + kq * 2048, QTile::kBlockBytes, 1024));
}

// dQ (m64 x D/2: all 64 rows, dims dq_col0..) = dS K over the tile's 128 keys, both warpgroups'
// dS^T from the tile at sDS; issued, not committed.
template <typename T, int D, int BK, typename STile, typename KTile>
__device__ __forceinline__ void bwd_sm90_issue_dq(float (&dq)[D / 4], const uint32_t& sDS, const uint32_t& sK,
                                                  const int& dq_col0) {
  constexpr int kDqCols = D / 2;
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    const uint32_t krow_off = kk * 16 * 128;
    const uint64_t a = wgmma_desc(sDS + krow_off, STile::kBlockBytes, 1024);
    const uint64_t b = wgmma_desc(sK + (dq_col0 / 64) * KTile::kBlockBytes + (dq_col0 % 64) * 2 + krow_off,
                                  KTile::kBlockBytes, 1024);
    WgmmaSS<kDqCols, 1, 1, T>::run(dq, a, b);
  }
}

// A consumer thread's whole run (tid: its thread in the CTA, >= 128): who it is, dK = dV = 0, every
// tile of the CTA in the visiting order, the dQ writer's stop, dK and dV.  The template flags are
// the kernel's (bwd/sm90_kernel.cuh).  What the kernel computed comes by reference, as into the
// forward's consumers (fwd/sm90_consumer.cuh says why).
//   smem, sbase: the shared base (BwdWs::Storage); sK .. sDQ: its tiles; mb_kv, qring, doring,
//   mb_vote, mb_dq_full, mb_dq_empty, mb_dec: its mbarriers; vote_w, s_dec, s_dq_row: the vote words,
//   the decisions for the dO producer, the row for the dQ writer; is_scored(t): whether tile t is
//   scored (kFwdMask); qlen .. n_iter: the CTA's work (BwdWork).
template <typename T, int D, bool kDense, bool kFwdMask, bool kDet, typename Scored>
__device__ __forceinline__ void bwd_sm90_consume(
    const BwdParams& p, const BwdWork& w, const int& tid, unsigned char* const& smem, const uint32_t& sbase,
    const uint32_t& sK, const uint32_t& sV, const uint32_t& sQ, const uint32_t& sDO, const uint32_t& sDS,
    const uint32_t& sDQ, const uint32_t& mb_kv, const MbarRing<BwdWs<D, kDet>::kQStages>& qring,
    const MbarRing<2>& doring, const uint32_t& mb_vote, const uint32_t& mb_dq_full, const uint32_t& mb_dq_empty,
    const uint32_t& mb_dec, uint32_t* const& vote_w, volatile int* const& s_dec, volatile int* const& s_dq_row,
    const Scored& is_scored, const int& qlen, const int& klen, const int& kb, const int& kn, const int& n_iter) {
  using C = BwdWs<D, kDet>;
  constexpr int BQ = C::BQ, BK = C::BK, NQS = C::kQStages;
  using KTile = typename C::KTile;
  using QTile = typename C::QTile;
  using STile = typename C::STile;
  using Sm = typename C::Storage;
  setmaxnreg_inc240();
  const int ctid = tid - 128, warp = __shfl_sync(0xffffffffu, ctid >> 5, 0), lane = ctid & 31, wg = warp >> 2,
            wl = warp & 3, gid = lane >> 2, tig = lane & 3;
  const int krow = 64 * wg + 16 * wl + gid;  // this thread's first key row in the tile (+8: second)
  const float* lse_s = reinterpret_cast<const float*>(smem + offsetof(Sm, lse));
  const float* bound_s = reinterpret_cast<const float*>(smem + offsetof(Sm, bound));
  const float* dsum_s = reinterpret_cast<const float*>(smem + offsetof(Sm, dsum));

  float dk[D / 2], dv[D / 2];  // m64nD accumulators: keys 64 wg.., all D dims
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

  // dQ of the tile (m64 x D/2 per warpgroup): warpgroup g takes dims (D/2) g.. over all 128 keys, so
  // that the writer adds each element once per tile (at d = 64 the B operand starts half-way into
  // K's 128-byte swizzle rows).
  constexpr int kDqCols = D / 2;
  const int dq_col0 = kDqCols * wg;
  const bool recording = p.tile_mask != nullptr || p.bwd_slots != nullptr;

  mbar_wait<true>(mb_kv, 0);
  // The dQ writer's handshake: wait_dq_buffer() before the k-th post writes the buffer (the writer
  // is done with post k - 1), post_dq(): the tile's first accumulator row (-1: no more) and this
  // warp's arrival.
  int n_posts = 0;
  auto wait_dq_buffer = [&]() {
    if (n_posts > 0) mbar_wait<true>(mb_dq_empty, bwd_ws_parity(n_posts - 1));
  };
  auto post_dq = [&](int row) {
    if (ctid == 0) s_dq_row[0] = row;
    __syncwarp();
    if (lane == 0) mbar_arrive(mb_dq_full);
    ++n_posts;
  };
  // Masked entries of S^T -> -inf (tiles that cross the diagonal or an end).  Entry 4n + 2hh + c: key
  // krow + 8hh, query row q0 + 8n + 2tig + c.  The scores stay raw: the test takes them raw.
  auto mask_scores = [&](float(&s)[32], int q0) {
    if (keys_x_rows_needs_mask(q0, BQ, kb, BK, qlen, klen, p.causal))
      apply_mask_keys_x_rows<8>(s, kb + krow, q0, lane, qlen, klen, p.causal);
  };
  // Whether some entry of this warp blocks the skip (the offline test against each row's raw bound).
  auto warp_blocks = [&](const float(&s)[32], const float* bound_t) {
    return __any_sync(0xffffffffu, keys_x_rows_blocks_skip<8>(s, bound_t, lane));
  };
  // After the decision on tile t: the producer's copy, the optional outputs.
  auto decided = [&](int u, int h, int qi, bool retain) {
    if (!kDense && ctid == 0) {
      s_dec[u & 7] = (u << 1) | (retain ? 1 : 0);
      mbar_arrive(mb_dec + 8 * (u & 7));
    }
    if (recording) bwd_record_tile<BQ, BK>(p, w, h, qi, retain, ctid);
  };
  // A skipped tile: its Q slot goes back (S^T is complete).
  auto skipped = [&](int qs) {
    if (lane == 0) qring.release(qs);
  };
  // A skipped tile's dO slot goes back once its (byte-less) phase has completed, a tile late so that
  // the skip path does not wait for the producer.
  int pend_do = -1;
  auto release_pending_do = [&]() {
    if (pend_do >= 0) {
      mbar_wait<true>(doring.full(pend_do & 1), bwd_ws_parity(pend_do >> 1));
      if (lane == 0) doring.release(pend_do & 1);
      pend_do = -1;
    }
  };

  BwdWork::Tile x = w.tile(0);
  int n_mvotes = 0;                 // mbarrier votes so far (their ring's index)
  bool retain_1 = true, retain_2 = true;  // the last two scored tiles' decisions: a tile's dO was
                                          // loaded speculatively when the one two scored tiles
                                          // before it was retained
  // t: the tile in the visiting order; u (kFwdMask): the tiles scored so far.  The rings' index is
  // u with kFwdMask, else t; the Q ring's slot and use are counters of the same.
  int t = 0, u = 0, qs_n = 0, quse_n = 0;
  auto advance = [&](bool was_scored) {
    ++t;
    x = w.next(x);
    // kFwdMask: the empty asm stops LLVM carrying values derived from the tile (its head, row and
    // mask word) across iterations.  Without it that instance's ring slots left the uniform
    // datapath (127 R2UR per kernel against 31: every wgmma descriptor built in regular registers
    // and moved over) and its loop state spilled.
    if constexpr (kFwdMask) asm volatile("" : "+r"(x.v));
    if (!kFwdMask || was_scored) {
      if constexpr (kFwdMask) ++u;
      if (++qs_n == NQS) {
        qs_n = 0;
        ++quse_n;
      }
    }
  };
  // The tile in two copies: dO_t prefetched (tile t - 2 retained; dP^T issued right behind S^T), or
  // loaded only once the tile is retained.  (One copy with a run-time branch
  // makes ptxas serialize every wgmma of the kernel.)
  auto step = [&](auto early) {
    constexpr bool dp_early = decltype(early)::value;
    float s[32], dp[32];
    const int ring_t = kFwdMask ? u : t;
    const int qs = qs_n;
    mbar_wait<true>(qring.full(qs), bwd_ws_parity(quse_n));
    // This tile's rows in the scalar slots (kVec above).
    const int vec0 = static_cast<int>((x.h() * p.rows_q_cap + w.qrow0 + x.qi() * BQ) & 3);
    const float* bound_t = bound_s + qs * C::kVecStride + vec0;
    // The bounds of this thread's first two query rows, for the retained-tile shortcut below.
    float2 early_bound = make_float2(0.f, 0.f);
    if (!kDense && dp_early) early_bound = make_float2(bound_t[2 * tig], bound_t[2 * tig + 1]);
    bwd_sm90_keys_x_rows<T, D, KTile, QTile>(s, sK, sQ + qs * QTile::kBytes, wg);
    if constexpr (dp_early) {
      mbar_wait<true>(doring.full(ring_t & 1), bwd_ws_parity(ring_t >> 1));
      bwd_sm90_keys_x_rows<T, D, KTile, QTile>(dp, sV, sDO + (ring_t & 1) * QTile::kBytes, wg);
      release_pending_do();
      wgmma_wait<1>();
      wgmma_fence_operands(s);
      mask_scores(s, x.qi() * BQ);
      bool retain = true;
      if (!kDense) {
        // A warp first tests only its first two query rows; the full test runs only when none of
        // those blocks the skip (same decisions, fewer instructions where tiles are kept).
        auto blocks = [&](int c, float bound) { return !rule::row_allows_skip_raw(rule::nan_max(s[c], s[2 + c]), bound); };
        bool warp_retain = __any_sync(0xffffffffu, blocks(0, early_bound.x) || blocks(1, early_bound.y));
        if (!warp_retain) warp_retain = warp_blocks(s, bound_t);
        // The mbarrier vote: warps that retain do not wait (on inputs that keep most tiles, none does).
        cta_vote_arrive(warp_retain, vote_w, mb_vote, n_mvotes, lane);
        retain = __any_sync(0xffffffffu, warp_retain || cta_vote_result(vote_w, mb_vote, n_mvotes));
        ++n_mvotes;
      }
      decided(ring_t, x.h(), x.qi(), retain);
      retain_2 = retain_1;
      retain_1 = retain;
      if (!retain) {
        wgmma_wait<0>();  // dP^T's reads of dO_t end before its slot goes back
        if (lane == 0) doring.release(ring_t & 1);
        skipped(qs);
        return;
      }
    } else {
      release_pending_do();
      wgmma_wait<0>();
      wgmma_fence_operands(s);
      mask_scores(s, x.qi() * BQ);
      // After a skipped tile most warps would wait for the vote anyway: one hardware barrier.
      const bool retain = __any_sync(0xffffffffu, barrier_vote_or(C::kBarVote, C::kConsumers, warp_blocks(s, bound_t)));
      decided(ring_t, x.h(), x.qi(), retain);
      if (!retain) {
        pend_do = ring_t;
        skipped(qs);
        retain_2 = retain_1;
        retain_1 = false;
        return;
      }
      retain_2 = retain_1;
      retain_1 = true;
      release_pending_do();
      mbar_wait<true>(doring.full(ring_t & 1), bwd_ws_parity(ring_t >> 1));
      bwd_sm90_keys_x_rows<T, D, KTile, QTile>(dp, sV, sDO + (ring_t & 1) * QTile::kBytes, wg);
    }
    // Retained tile t.  Its dS^T goes into the one buffer once the other warpgroup's dQ products of
    // the last retained tile have read it: both warpgroups post to the writer only after those, so
    // the last post's phase of the writer's full barrier says so.  (The barrier is at most that phase
    // on: the next one needs this warpgroup's own post.)  Waited for here, where dP^T still runs.
    if (n_posts > 0) mbar_wait<true>(mb_dq_full, bwd_ws_parity(n_posts - 1));
    const int ds = ring_t & 1, h = x.h(), q0 = x.qi() * BQ;
    const uint32_t sQs = sQ + qs * QTile::kBytes, sDOs = sDO + ds * QTile::kBytes;
    const float* unit_t = reinterpret_cast<const float*>(smem + offsetof(Sm, unit)) + qs * C::kVecStride + vec0;
    // P = exp2(S - lse) while dP^T is computed.
    const float* lse_t = lse_s + qs * C::kVecStride + vec0;
    bwd_sm90_probs(s, lse_t, p.scale_log2, tig);
    wgmma_wait<0>();
    wgmma_fence_operands(dp);
    const float* dsum_t = dsum_s + ds * C::kVecStride + vec0;
    bwd_sm90_dscores(dp, s, dsum_t, tig);
    uint32_t pa[4][4], da[4][4];
    bwd_sm90_pack<T>(s, dp, pa, da);
    // dS^T -> shared memory for dQ (the buffer is free: the wait at the top of the tile).
    unsigned char* dsb = smem + offsetof(Sm, ds);
    bwd_sm90_store_ds<STile>(dsb, da, krow, tig);
    fence_proxy_async_smem();
    // dV += P^T dO (while the warpgroups meet), then dQ, then dK += dS^T Q: dQ goes to the writer's
    // buffer while dK still runs (FlashAttention-3's order), instead of after it.
    wgmma_fence();
    bwd_sm90_issue_rows_x_d<T, D, QTile>(dv, pa, sDOs);
    wgmma_commit();
    // dQ once both warpgroups' dS^T are in shared memory.
    named_barrier_sync(C::kBarDs, C::kConsumers);
    float dq[kDqCols / 2];
#pragma unroll
    for (int i = 0; i < kDqCols / 2; ++i) dq[i] = 0.f;
    wgmma_fence();
    bwd_sm90_issue_dq<T, D, BK, STile, KTile>(dq, sDS, sK, dq_col0);
    wgmma_commit();
    bwd_sm90_issue_rows_x_d<T, D, QTile>(dk, da, sQs);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ (groups complete in order): dO_t is free, dQ is ready
    wgmma_fence_operands(dv);
    wgmma_fence_operands(dq);
    if (lane == 0) doring.release(ds);
    // dQ -> the writer's buffer (bwd/sm90_epilogue.cuh).
    wait_dq_buffer();
    bwd_sm90_stage_dq<D, kDet>(dq, sDQ, dq_col0, wl, gid, tig, unit_t);
    fence_proxy_async_smem();
    post_dq(static_cast<int>(h * p.rows_q_cap + w.qrow0 + q0));
    wgmma_wait<0>();  // dK: Q_t is free
    wgmma_fence_operands(dk);
    if (lane == 0) qring.release(qs);
  };
  while (t < n_iter) {
    if constexpr (kFwdMask) {
      if (!is_scored(t)) {  // skipped unscored: no ring, no vote
        if (recording) bwd_record_tile<BQ, BK>(p, w, x.h(), x.qi(), false, ctid);
        advance(false);
        continue;
      }
    }
    if (kDense || retain_2)
      step(std::true_type{});
    else
      step(std::false_type{});
    advance(true);
  }
  // The writer stops once it has added the last tile.
  wait_dq_buffer();
  post_dq(-1);
  bwd_sm90_store_dkdv<T, D>(p, w, krow, kn, tig, dk, dv);
}

}  // namespace cuda
}  // namespace mala

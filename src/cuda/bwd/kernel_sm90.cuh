// The backward main kernel on Hopper tensor cores (wgmma), head dims 64 and 128, tau = 0 and tau > 0
// (sm_90a; the mma.sync kernel in kernel_sm80.cuh serves d = 256 and other devices).  Same work split,
// offline test, vote and outputs as that kernel -- one CTA per (key tile of 128 keys, sequence, KV
// head, head split), query tiles of 64 rows ascending from the first legal one, dK/dV in registers,
// dQ added to the fp32 workspace -- but the
// five products are warpgroup MMAs whose B operand (and A, for S, dP and dQ) is read by the tensor
// cores straight from shared memory, once per warpgroup instead of once per warp: the mma.sync
// kernel is bound by that shared-memory traffic (docs/kernels.md, profile of the backward).
//
// Two warpgroups (256 threads); warpgroup g owns keys 64g..64g+63 of the tile.  Per query tile:
//   S^T_g  = K_g Q^T        m64n64, A = K (K-major), B = Q (K-major), 8 k-steps over d
//   dP^T_g = V_g dO^T       likewise
//   P^T = exp2(S^T - lse), dS^T = P^T (dP^T - D)   in registers (accumulator layout = mma.sync C)
//   dV_g  += P^T dO         m64n128, A = P^T from registers, B = dO (MN-major), 4 k-steps over q
//   dK_g  += dS^T Q         likewise with dS^T and Q
//   dS^T -> shared memory; at the next iteration (after its top barrier, so no extra barrier):
//   dQ[:, 64g..64g+63] += dS K   m64n64, A = dS (MN-major: dS^T is stored [key][q]), B = K (MN-major)
//   (d = 64: warpgroup g adds dS[:, its keys] K[its keys] to all 64 columns instead)
// A tile skipped by the test (tau > 0) stops after S^T, which it compares raw against each query
// row's bound (rule::skip_bound_raw, written by the preprocess kernel): unscaled, and masked only when
// it crosses the diagonal or an end, so a skipped tile costs few instructions; after a retained tile a
// warp first tests only its first two query rows, against bounds read before the iteration's wgmma,
// and the rest only when those allow the skip (same decisions).  Shared-memory tiles use the
// 128-byte swizzle wgmma reads (GmmaTile); loads are cp.async with the mma.sync kernel's pipeline (3 Q stages, dO only
// for retained tiles plus a speculative dO of the next), made visible to the tensor cores' async proxy
// by fence.proxy.async before the barrier.
#pragma once

#include <type_traits>

#include "cuda/bwd/common.cuh"
#include "cuda/core/gmma_layout.h"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/wgmma.cuh"

namespace mala {
namespace cuda {

template <int D_>
struct BwdSm90 {
  static constexpr BwdTiles kTiles = bwd_tiles(BwdKernelKind::sm90, D_);  // bwd/tiles.h
  static constexpr int D = D_, BQ = kTiles.bq, BK = kTiles.bk, kThreads = 256, kWarps = 8, kQStages = kTiles.q_stages;
  static_assert(D == 64 || D == 128, "wgmma backward: head dim 64 or 128");
  using KTile = GmmaTile<BK, D>;   // K, V: 32 KB at d = 128
  using QTile = GmmaTile<BQ, D>;   // Q, dO stage: 16 KB at d = 128
  using STile = GmmaTile<BK, BQ>;  // dS^T [key][query]: 16 KB
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + KTile::kBytes;
  static constexpr int kOffQ = kOffV + KTile::kBytes;               // kQStages stages
  static constexpr int kOffDO = kOffQ + kQStages * QTile::kBytes;   // 2 stages
  static constexpr int kOffDS = kOffDO + 2 * QTile::kBytes;         // 2 buffers
  static constexpr int kOffLse = kOffDS + 2 * STile::kBytes;        // [kQStages][BQ], log2 units
  static constexpr int kOffBound = kOffLse + kQStages * BQ * 4;     // [kQStages][BQ], raw-score skip bound
  static constexpr int kOffDsum = kOffBound + kQStages * BQ * 4;    // [2][BQ]
  static constexpr int kOffMbar = kOffDsum + 2 * BQ * 4;            // 2 x u64 mbarrier (vote)
  static constexpr int kOffVote = kOffMbar + 16;                    // 2 x u32 flags
  static constexpr int kOffTile = kOffVote + 16;                    // [kQStages] BwdWork::Tile of each Q stage
  static constexpr int kBytes = kOffTile + 16;
  static constexpr int kSmem = kBytes + 1024;  // slack to align the base to 1024 bytes
};

template <typename T, int D, bool kDense>
__global__ void __launch_bounds__(256, 1) bwd_main_kernel_sm90(const BwdParams p) {
#ifdef MALA_WGMMA_ENABLED
  using KC = BwdSm90<D>;
  constexpr int BQ = KC::BQ, BK = KC::BK, NQS = KC::kQStages;
  using KTile = typename KC::KTile;
  using QTile = typename KC::QTile;
  using STile = typename KC::STile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wl = warp & 3;
  const int gid = lane >> 2, tig = lane & 3;

  const BwdWork w = bwd_cta_work<BQ, BK>(p);
  if (w.kb >= w.klen) return;
  const int qlen = w.qlen, klen = w.klen, kb = w.kb, kn = w.kn, n_iter = w.n_iter;
  const int64_t qrow0 = w.qrow0;

  const BwdRows<T> rows = bwd_rows<T>(p, w);
  const T *q_base = rows.q, *do_base = rows.dout, *k_ptr = rows.k, *v_ptr = rows.v;
  const uint32_t sK = sbase + KC::kOffK, sV = sbase + KC::kOffV, sQ = sbase + KC::kOffQ, sDO = sbase + KC::kOffDO,
                 sDS = sbase + KC::kOffDS;
  const float* lse_s = reinterpret_cast<const float*>(smem + KC::kOffLse);
  const float* bound_s = reinterpret_cast<const float*>(smem + KC::kOffBound);
  const float* dsum_s = reinterpret_cast<const float*>(smem + KC::kOffDsum);

  // The tile of each Q stage, written by thread 0 with its load and read after a later top barrier:
  // each iteration finds its own tile and the next one there (t + 2's is w.next of t + 1's), so no
  // tile is carried in registers and none is divided out of t (the divisions slow the dense
  // instance; carried in registers, the tiles spill in the tau > 0 instance).
  uint32_t* tile_s = reinterpret_cast<uint32_t*>(smem + KC::kOffTile);
  auto load_q = [&](BwdWork::Tile x, int stage) {
    if (tid == 0) tile_s[stage] = x.v;
    const int h = x.h(), r0 = x.qi() * BQ, valid = min(BQ, qlen - r0);
    QTile::load_async<KC::kThreads>(sQ + stage * QTile::kBytes, q_base + static_cast<int64_t>(r0) * p.q_r + h * p.q_h,
                                    p.q_r, valid, tid);
    bwd_load_lse_bound<BQ, !kDense>(p, w, h, r0, valid, sbase + KC::kOffLse + stage * BQ * 4,
                                  sbase + KC::kOffBound + stage * BQ * 4);
  };
  auto load_do = [&](BwdWork::Tile x, int stage) {
    const int h = x.h(), r0 = x.qi() * BQ, valid = min(BQ, qlen - r0);
    QTile::load_async<KC::kThreads>(sDO + stage * QTile::kBytes,
                                    do_base + static_cast<int64_t>(r0) * p.do_r + h * p.do_h, p.do_r, valid, tid);
    bwd_load_dsum<BQ>(p, w, h, r0, valid, sbase + KC::kOffDsum + stage * BQ * 4);
  };

  KTile::load_async<KC::kThreads>(sK, k_ptr, p.k_r, kn, tid);
  KTile::load_async<KC::kThreads>(sV, v_ptr, p.v_r, kn, tid);
  cp_async_commit();

  float dk[D / 2], dv[D / 2];  // m64nD accumulators: keys 64wg.., all D dims
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

  // dQ[q0.., 64 columns] += dS K (m64n64 per warpgroup) for the tile whose dS^T is in buffer `buf`.
  // d = 128: warpgroup g takes dims 64g.. over all 128 keys.  d = 64: warpgroup g takes all 64 dims
  // over its own keys 64g.. and both add their partial dQ to the workspace.
  constexpr bool kDqSplitKeys = D == 64;
  constexpr int kDqKeys = kDqSplitKeys ? 64 : BK;
  const int dq_key0 = kDqSplitKeys ? 64 * wg : 0, dq_col0 = kDqSplitKeys ? 0 : 64 * wg;
  auto do_dq = [&](int h, int q0, int buf) {
    float dq[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dq[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kDqKeys / 16; ++kk) {
      const uint32_t krow_off = (dq_key0 + kk * 16) * 128;
      const uint64_t da = wgmma_desc(sDS + buf * STile::kBytes + krow_off, STile::kBlockBytes, 1024);
      const uint64_t db = wgmma_desc(sK + (dq_col0 / 64) * KTile::kBlockBytes + krow_off, KTile::kBlockBytes, 1024);
      WgmmaSS<64, 1, 1, T>::run(dq, da, db);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(dq);
    float* dqa = p.dq_acc + (h * p.rows_q_cap + qrow0 + q0) * D + dq_col0 + 2 * tig;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = wl * 16 + gid + hh * 8;
      if (q0 + r < qlen) {
#pragma unroll
        for (int n = 0; n < 8; ++n) bwd_red_add2(dqa + r * D + n * 8, dq[4 * n + 2 * hh], dq[4 * n + 2 * hh + 1]);
      }
    }
  };
  const bool recording = p.tile_mask != nullptr || p.bwd_slots != nullptr;
  auto record = [&](int tt, bool keep) { bwd_record<BQ, BK>(p, w, tt, keep); };
  // The vote of tau > 0 (as bwd_main_kernel): two mbarriers + two flags.
  uint32_t* vote_s = reinterpret_cast<uint32_t*>(smem + KC::kOffVote);
  const uint32_t mbar_s = sbase + KC::kOffMbar;
  if (!kDense && tid == 0) {
    mbar_init(mbar_s, KC::kWarps);
    mbar_init(mbar_s + 8, KC::kWarps);
    vote_s[0] = vote_s[1] = 0u;
  }

  // Pipeline (as bwd_main_kernel with 3 Q stages): Q_{t+2} is issued after tile t's decision, dO_t
  // only for a retained tile, and dO_{t+1} speculatively when tile t is retained.
  bool do_ready = false;
  if (n_iter > 0) {
    const BwdWork::Tile first = w.tile(0);
    load_q(first, 0);
    cp_async_commit();
    load_do(first, 0);
    cp_async_commit();
    do_ready = true;
    if (n_iter > 1) {
      load_q(w.next(first), 1);
      cp_async_commit();
    }
  }

  bool pend = false, last_retain = false;
  int pend_h = 0, pend_q0 = 0, pend_buf = 0;
  const int krow = 64 * wg + 16 * wl + gid;  // this thread's first key row in the tile (+8: second)
  for (int t = 0; t < n_iter; ++t) {
    const int st = t & 1, qs = t % NQS;
    if (t + 1 < n_iter)
      cp_async_wait<1>();  // Q_{t+1} may stay in flight
    else
      cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();  // Q_t (and dO_t when prefetched) visible; older stages and dS^T buffer st free
    if (!kDense && tid == 0) vote_s[st ^ 1] = 0u;
    // The tiles of this iteration and the next (both words written before this barrier, with their Q
    // loads), read where they are used: volatile, so that ptxas reloads them rather than holding
    // them in registers across the step (which spilled).
    auto tile_of = [&](int stage) { return BwdWork::Tile{*reinterpret_cast<volatile uint32_t*>(tile_s + stage)}; };
    const int qs1 = qs == NQS - 1 ? 0 : qs + 1;
    const BwdWork::Tile x0 = tile_of(qs);
    const int h = x0.h(), q0 = x0.qi() * BQ;
    // The bounds of this thread's first two query rows (columns 2 tig, 2 tig + 1) for the retained-tile
    // shortcut of tau > 0 below, read here, before any wgmma of the iteration is in flight (read
    // behind S^T's and dP^T's wgmma, the test would wait for them).
    float2 early_bound = make_float2(0.f, 0.f);
    if (!kDense && do_ready) early_bound = *reinterpret_cast<const float2*>(bound_s + qs * BQ + 2 * tig);
    if (recording && t > 0) record(t - 1, last_retain);
    if (pend) {
      do_dq(pend_h, pend_q0, pend_buf);
      pend = false;
    }
    // The rest of the tile, in two copies: with dP^T issued right behind S^T (dO_t is here) or after
    // the decision.  (One copy with a run-time branch made ptxas serialize every wgmma of the kernel.)
    auto rest = [&](auto early) {
      const uint32_t sQs = sQ + qs * QTile::kBytes, sDOs = sDO + st * QTile::kBytes;

      // S^T = K_g Q^T (and, tau = 0, dP^T = V_g dO^T right behind it).
      float s[32], dp[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] = dp[e] = 0.f;
      // acc (this warpgroup's 64 keys x 64 rows) += X_g Y^T over d, X = K or V, Y = Q or dO; committed.
      auto keys_x_rows = [&](float(&acc)[32], uint32_t sX, uint32_t sY) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t xa = (kk >> 2) * KTile::kBlockBytes + 64 * wg * 128 + (kk & 3) * 32;
          const uint32_t ya = (kk >> 2) * QTile::kBlockBytes + (kk & 3) * 32;
          WgmmaSS<64, 0, 0, T>::run(acc, wgmma_desc(sX + xa, 16, 1024), wgmma_desc(sY + ya, 16, 1024));
        }
        wgmma_commit();
      };
      auto issue_dp = [&]() { keys_x_rows(dp, sV, sDOs); };
      wgmma_fence();
      keys_x_rows(s, sK, sQs);
      // dP^T goes right behind S^T whenever dO_t is already here: always at tau = 0, and at tau > 0
      // after a retained tile (speculatively, like the dO prefetch: on inputs where tiles are kept it
      // overlaps the mask, the test and the vote; a skipped tile wastes it).
      constexpr bool dp_early = decltype(early)::value;
      if constexpr (dp_early) {
        issue_dp();
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
      wgmma_fence_operands(s);

      const bool need_mask = keys_x_rows_needs_mask(q0, BQ, kb, BK, qlen, klen, p.causal);
      const float* lse_t = lse_s + qs * BQ;
      if (need_mask) {
        // Masked entries -inf: a branch of its own, taken only by the tiles that cross the diagonal or
        // an end (written into a loop over every tile, ptxas computed the mask for every tile).  The
        // scores stay raw: tau > 0 tests them raw, and P = exp2(S scale - lse) scales them.
        // Entry 4n + 2hh + c: key krow + 8hh, query row q0 + 8n + 2tig + c.
        apply_mask_keys_x_rows<8>(s, kb + krow, q0, lane, qlen, klen, p.causal);
      }
      bool retain = true;
      if (!kDense) {
        // The offline test on the max of this thread's two raw entries per query row against the row's
        // bound (rule::skip_bound_raw, from the preprocess kernel), then the CTA vote.
        auto blocks_skip = [&](int n, int c, float bound) {
          return !rule::row_allows_skip_raw(rule::nan_max(s[4 * n + c], s[4 * n + 2 + c]), bound);
        };
        // After a retained tile (the dp_early copy) this one is likely retained too: a warp first tests
        // only its first two query rows against the bounds read at the top (32 x 4 entries per warp;
        // on random inputs some entry blocks the skip), and tests every row only when none of those
        // does.  Either way it retains exactly when some entry exceeds its row's bound: the decisions
        // are those of the full test, at a fraction of its cost on inputs that retain most tiles.
        bool warp_retain = false;
        if constexpr (dp_early)
          warp_retain = __any_sync(0xffffffffu, blocks_skip(0, 0, early_bound.x) || blocks_skip(0, 1, early_bound.y));
        if (!warp_retain) {
          const float* bound_t = bound_s + qs * BQ;
          bool block = false;
#pragma unroll
          for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) block |= blocks_skip(n, c, bound_t[n * 8 + 2 * tig + c]);
          warp_retain = __any_sync(0xffffffffu, block);
        }
        // The CTA vote; its result is the same on every lane already, and through __any_sync
        // ptxas knows it to be warp-uniform, so the branches on it below need no divergence handling.
        retain = __any_sync(0xffffffffu, cta_vote_mbarrier(warp_retain, vote_s, mbar_s, st, t));
      }
      const bool q_late = t + 2 < n_iter;
      last_retain = retain;
      if (!retain) {
        if constexpr (dp_early) wgmma_wait<0>();  // its reads of V and dO_t end before the next loads
        if (q_late) {
          load_q(w.next(tile_of(qs1)), (t + 2) % NQS);
          cp_async_commit();
        }
        do_ready = false;
        return;
      }
      // common.cuh's bwd_issue_retained, written out: here dO_t's presence is partly known at
      // compile time (the dp_early copy).
      const bool spec = t + 1 < n_iter;
      // The dp_early copy runs only where dO_t was prefetched: saying so at compile time takes the
      // on-demand dO load and its barrier out of that copy.
      const bool had_do = dp_early || do_ready;
      if (!kDense) {
        if (!had_do) {
          load_do(tile_of(qs), st);
          cp_async_commit();
        }
      }
      if (spec) {
        load_do(tile_of(qs1), st ^ 1);
        cp_async_commit();
      }
      if (q_late) {
        load_q(w.next(tile_of(qs1)), (t + 2) % NQS);
        cp_async_commit();
      }
      if (!kDense) {
        if (!had_do) {  // dO_t was not prefetched
          bwd_wait_do((spec ? 1 : 0) + (q_late ? 1 : 0));
          fence_proxy_async_smem();
          __syncthreads();
        }
        if constexpr (!dp_early) {
          wgmma_fence();
          issue_dp();
        }
      }
      do_ready = spec;
      // P = exp2(S - lse) while dP^T is computed, after the vote: a skipped tile does not pay for it.
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float l2 = lse_t[n * 8 + 2 * tig + c];
          s[4 * n + c] = exp2f(s[4 * n + c] * p.scale_log2 - l2);
          s[4 * n + 2 + c] = exp2f(s[4 * n + 2 + c] * p.scale_log2 - l2);
        }
      wgmma_wait<0>();
      wgmma_fence_operands(dp);
      const float* dsum_t = dsum_s + st * BQ;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float dd = dsum_t[n * 8 + 2 * tig + c];
          dp[4 * n + c] = s[4 * n + c] * (dp[4 * n + c] - dd);
          dp[4 * n + 2 + c] = s[4 * n + 2 + c] * (dp[4 * n + 2 + c] - dd);
        }
      uint32_t pa[4][4], da[4][4];
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        pa[kq][0] = pack2<T>(s[8 * kq + 0], s[8 * kq + 1]);
        pa[kq][1] = pack2<T>(s[8 * kq + 2], s[8 * kq + 3]);
        pa[kq][2] = pack2<T>(s[8 * kq + 4], s[8 * kq + 5]);
        pa[kq][3] = pack2<T>(s[8 * kq + 6], s[8 * kq + 7]);
        da[kq][0] = pack2<T>(dp[8 * kq + 0], dp[8 * kq + 1]);
        da[kq][1] = pack2<T>(dp[8 * kq + 2], dp[8 * kq + 3]);
        da[kq][2] = pack2<T>(dp[8 * kq + 4], dp[8 * kq + 5]);
        da[kq][3] = pack2<T>(dp[8 * kq + 6], dp[8 * kq + 7]);
      }
      // dS^T -> shared memory for the deferred dQ (read after the next top barrier).
      unsigned char* dsb = smem + KC::kOffDS + st * STile::kBytes;
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        const int c = kq * 16 + 2 * tig;
        *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow, c)) = da[kq][0];
        *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow + 8, c)) = da[kq][1];
        *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow, c + 8)) = da[kq][2];
        *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow + 8, c + 8)) = da[kq][3];
      }
      fence_proxy_async_smem();

      // dV += P^T dO, dK += dS^T Q.
      wgmma_fence();
#pragma unroll
      for (int kq = 0; kq < 4; ++kq)
        WgmmaRS<D, 1, T>::run(dv, pa[kq], wgmma_desc(sDOs + kq * 2048, QTile::kBlockBytes, 1024));
#pragma unroll
      for (int kq = 0; kq < 4; ++kq)
        WgmmaRS<D, 1, T>::run(dk, da[kq], wgmma_desc(sQs + kq * 2048, QTile::kBlockBytes, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
      pend = true;
      pend_h = h;
      pend_q0 = q0;
      pend_buf = st;
    };
    if (kDense || do_ready)
      rest(std::true_type{});
    else
      rest(std::false_type{});
  }
  cp_async_wait<0>();
  __syncthreads();
  if (pend) do_dq(pend_h, pend_q0, pend_buf);
  if (recording && n_iter > 0) record(n_iter - 1, last_retain);

  // Epilogue: dK (scaled), dV.  Accumulator element 4n + 2hh + c: key krow + 8hh, dim 8n + 2tig + c.
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = krow + hh * 8;
    if (r >= kn) continue;
    bwd_store_dkdv_row<T, D, D / 8>(p, w, r, 2 * tig, [&](int n) {
      return make_float4(dk[4 * n + 2 * hh], dk[4 * n + 2 * hh + 1], dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1]);
    });
  }
#endif
}

// Launches the instance `dense` names (grid as the mma.sync kernel's).
template <typename T, int D>
cudaError_t launch_bwd_sm90(const BwdParams& p, bool dense, cudaStream_t stream) {
  using KC = BwdSm90<D>;
  auto kernel = dense ? bwd_main_kernel_sm90<T, D, true> : bwd_main_kernel_sm90<T, D, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, KC::kSmem);
  if (err != cudaSuccess) return err;
  const int64_t grid = static_cast<int64_t>(p.n_k_tiles) * p.batch * p.heads_kv * p.head_splits;
  if (grid <= 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), KC::kThreads, KC::kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

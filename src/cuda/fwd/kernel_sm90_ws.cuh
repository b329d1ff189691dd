// The warp-specialized forward on Hopper (wgmma + TMA, two S accumulators), head dims 64, 128 and
// 256, sm_90a: run only under the kernel override (FwdVariant::wgmma_ws), for tests and A/B timing
// against the 128-key kernel that the dispatch picks (fwd/kernel_sm90_k128.cuh).  It needs the TMA
// (varlen calls must give total_k).  kDense: the tau = 0 instance (no test, no vote, every V).
//
// Same decisions as the other forward kernels (decision tile 32 query rows x 64 keys, at d = 256 16
// x 32; key tiles from the diagonal down, the online test against the running normaliser), so the
// tile mask, the slots and the outputs are theirs.  A CTA is three warpgroups over 128 query rows:
//   producer (warpgroup 0, 24 registers; one thread issues every TMA load): K_t into a ring of
//     kKBufs slots (full/empty mbarriers, up to kKBufs tiles ahead); V_t into slot t % kVBufs of
//     the V ring, prefetched when the latest decision it has seen was a retention, else loaded
//     once both warpgroups have decided tile t if one of them retains it (each warpgroup stores its
//     decision, (t << 1) | retained, into a ring of kR slots and arrives on the slot's mbarrier,
//     which the producer tests, or waits on where it must know).  V_t's full
//     barrier completes once per tile either way (with no bytes when nobody needs V_t), so every
//     phase is static.
//   consumers (warpgroups 1 and 2, 240 registers, 64 rows each): per key tile, S = Q K^T (Q in
//     registers; at d = 256 in shared memory), mask, each lane's part of the raw row max against
//     a bound per row (rule::skip_bound_raw, recomputed after a retained tile), the pair vote (one
//     bar.red.popc over the warpgroup); a warpgroup with a retaining pair computes P and O += P V, its warps
//     on one path whatever their pair decided (a skipped pair's rows: P = 0, state kept, through
//     softmax_step_or_keep, which rescales O only when a row's maximum grew by more than
//     kRescaleSlack; the dense instance branches on the pair and uses the same update).  S of
//     the next tile runs on the tensor cores while a tile is exponentiated, and a tile is decided
//     while the previous tile's P V runs; the S after that is issued behind that P V before the
//     warpgroup waits for it (at tau > 0 while the vote's barrier resolves, which is read only
//     afterwards).  The consumers issue no loads and never wait for each other, except
//     through the rings' depth and when one needs the V of a tile the other has not decided yet.
#pragma once

#include <stddef.h>
#include <type_traits>

#include "cuda/core/pipeline.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/tma.cuh"
#include "cuda/core/wgmma.cuh"
#include "cuda/fwd/common.cuh"

namespace mala {
namespace cuda {

template <int D_>
struct FwdWs {
  static constexpr int D = D_;
  static_assert(fwd_has_sm90_ws(D), "warp-specialized forward: head dims 64, 128 and 256 (fwd/params.h)");
  // The decision tile is the mma.sync kernel's (fwd/tiles.h): 32 rows (a warp pair) x 64 keys at
  // d = 64 and 128, 16 rows (one warp) x 32 keys at d = 256.
  static constexpr FwdTiles kTiles = fwd_tiles(FwdKernelKind::sm90_ws, D);  // fwd/tiles.h
  static constexpr int kThreads = 384, BQ = kTiles.bq, BK = kTiles.bk, kDecWarps = kTiles.dec_warps;
  static_assert(kDecWarps == 1 || kDecWarps == 2, "a decision tile is one warp's rows or a pair's");
  // d = 256: O takes 128 registers a thread, which leaves none for Q's 64; Q stays in shared memory
  // (GmmaTile, an operand of an ss wgmma) instead of going to registers through ldmatrix.
  static constexpr bool kQSmem = D == 256;
  using QTile = std::conditional_t<kQSmem, GmmaTile<64, D>, SmemTile<64, D>>;
  using KVTile = GmmaTile<BK, D>;
  // K ring (the producer runs up to kKBufs tiles ahead), V ring indexed by tile (t % kVBufs; a tile
  // whose V is not loaded leaves its slot unused), the consumers' per-tile decisions (kR tiles).
  // Power-of-two rings: a slot and a phase are a mask and a shift, where five V slots would cost a
  // division per tile.  d = 256: 64 KB of Q leave room for four V slots.
  static constexpr int kKBufs = kTiles.k_stages, kVBufs = kTiles.v_stages, kLag = 2, kR = 8;
  static_assert(kR > kLag + kKBufs, "a decision slot is reused only after the producer has read it");
  static_assert(kVBufs >= 3, "V slots are given back two tiles late");
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char k[kKBufs][KVTile::kBytes];
    unsigned char v[kVBufs][KVTile::kBytes];
    unsigned char q[2][QTile::kBytes];  // one per consumer warpgroup
    uint64_t mbar[2 * kKBufs + 2 * kVBufs + kR];  // full_k[NK], empty_k[NK], full_v[NV], empty_v[NV], dec[kR]
    int dec[kR][2];  // (tile << 1) | retained
  };
  static_assert(offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, q) % 1024 == 0 &&
                    QTile::kBytes % 1024 == 0,
                "FwdWs::Storage: swizzled tiles at 1024-byte boundaries");
  static constexpr int kSmem = sizeof(Storage) + 1024;  // + the base's alignment
};

// kRecord: the instance for calls that record the tile mask; the others carry no code for it (the
// recording code costs the loop time even where it does not run).  kSeeded (tau > 0 only): a seeded
// split (fwd/common.cuh), likewise its own instance.
template <typename T, int D, bool kDense, bool kRecord, bool kSeeded>
__global__ void __launch_bounds__(384, 1)
    mala_fwd_kernel_sm90_ws(const FwdParams p, const __grid_constant__ CUtensorMap tmap_k,
                            const __grid_constant__ CUtensorMap tmap_v) {
#ifdef MALA_WGMMA_ENABLED
  using C = FwdWs<D>;
  constexpr int BQ = C::BQ, BK = C::BK, NT = BK / 8, DT = D / 8, KS = D / 16, NKB = C::kKBufs, NVB = C::kVBufs,
                R = C::kR;
  using QTile = typename C::QTile;
  using KVTile = typename C::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x, b = blockIdx.z, h = blockIdx.y;
  const int qtile = longest_first_query_tile(p.causal);
  const FwdSeq<T> sq = fwd_seq<T>(p, b, h);
  const int Nq = sq.Nq, Nk = sq.Nk;
  const int row_cta = qtile * BQ;
  const int n_tiles = sq.key_tiles(row_cta, BQ, BK, p.causal);
  const int top = n_tiles - 1;
  using Sm = typename C::Storage;
  Sm& st = *reinterpret_cast<Sm*>(smem);
  const uint32_t sK0 = sbase + offsetof(Sm, k), sV0 = sbase + offsetof(Sm, v);
  const MbarRing<NKB> kring = MbarRing<NKB>::at(sbase + offsetof(Sm, mbar));
  const MbarRing<NVB> vring = MbarRing<NVB>::at(kring.empty0 + 8 * NKB);
  const uint32_t mb_dec = vring.empty0 + 8 * NVB;
  // Warpgroup g's decision on tile t: (t << 1) | retained in s_dec[t % R][g], stored by the
  // warpgroup's thread 0, which then arrives on mbarrier dec[t % R] (smem_store_arrive_if:
  // predicated, no branch between the vote and the softmax; the consumers never wait on it).  The
  // producer tests the phase without waiting where a decision only steers a prefetch, and waits for
  // it where it must know.
  const int* s_dec = &st.dec[0][0];
  const uint32_t s_dec_addr = sbase + offsetof(Sm, dec);
  // Phase parity of tile t's use of a ring of n slots indexed by t % n (tiles run from top down);
  // unsigned, so that a power-of-two n costs a shift and a mask.
  auto phase = [&](int t, uint32_t n) { return ((uint32_t)(top - t) / n) & 1u; };
  auto ring = [](int t, uint32_t n) { return (uint32_t)t % n; };
  // Both warpgroups' decisions on tile x, once mbarrier dec[x % R] says they are in.
  auto retained_by_some = [&](int x) {
    const int* d = s_dec + 2 * ring(x, R);
    return ((d[0] | d[1]) & 1) != 0;
  };
  if (tid == 0) {
    kring.init(1, 8);  // one arrival per consumer warp
    vring.init(1, 8);
    for (int i = 0; i < R; ++i) mbar_init(mb_dec + 8 * i, 2);  // one arrival per consumer warpgroup
    fence_mbarrier_init();
  }
  __syncthreads();
  const int hk = h / p.group;
  // TMA coordinates of key row 0: varlen maps the packed rows as one batch entry.
  const int k_row0 = sq.k_off, k_batch = p.cu_k ? 0 : b;
  if (tid < 128) {  // producer warpgroup: one thread issues every load
    setmaxnreg_dec24();
    if (tid == 0 && n_tiles > 0) {
      auto load_k = [&](int t) {
        const uint32_t slot = ring(t, NKB);
        if (t + NKB <= top) mbar_wait<true>(kring.empty(slot), phase(t + NKB, NKB));
        tma_load_tile<BK, D>(sK0 + slot * KVTile::kBytes, &tmap_k, kring.full(slot), k_row0 + t * BK, hk, k_batch);
      };
      for (int t = top; t > top - NKB && t >= 0; --t) load_k(t);
      bool last_known = true;
      for (int t = top; t >= 0; --t) {
        // V_t: prefetched when the latest decision seen without waiting (that of tile t + kLag if
        // both warpgroups have made it) was a retention (the first kLag tiles always), else loaded
        // once both have decided tile t if one retains it; either way its full barrier completes
        // once for the tile (with no bytes when V_t is not needed).  (Waiting for tile t + kLag's
        // decisions instead would stall the producer behind the slower warpgroup.)
        const uint32_t slot = ring(t, NVB);
        if (t + NVB <= top) mbar_wait<true>(vring.empty(slot), phase(t + NVB, NVB));
        bool load = true;
        if (!kDense) {
          if (t + C::kLag <= top) {
            const int x = t + C::kLag;
            if (mbar_test(mb_dec + 8 * ring(x, R), phase(x, R))) last_known = retained_by_some(x);
            load = last_known;
          }
          if (!load) {
            mbar_wait<false>(mb_dec + 8 * ring(t, R), phase(t, R));
            load = retained_by_some(t);
          }
        }
        if (load) {
          tma_load_tile<BK, D>(sV0 + slot * KVTile::kBytes, &tmap_v, vring.full(slot), k_row0 + t * BK, hk, k_batch);
        } else {
          vring.fill_empty(slot);
        }
        if (t - NKB >= 0) load_k(t - NKB);
      }
    }
    return;
  }
  setmaxnreg_inc240();
  // The warp index through a shuffle, so that ptxas knows what is derived from it (the legal
  // ranges of the warpgroup and the pair) to be warp-uniform, and branches on them need no
  // divergence handling.
  // "pair": the warps of one decision tile (a warp pair, or at d = 256 the warp itself).
  constexpr int DW = C::kDecWarps, DR = 16 * DW;
  const int ctid = tid - 128, warp = __shfl_sync(0xffffffffu, ctid >> 5, 0), lane = ctid & 31, wg = warp >> 2,
            wl = warp & 3, pair = wl / DW;
  const int row_wg = row_cta + 64 * wg;
  const int row_pair = row_wg + DR * pair;
  const int row_w = row_wg + 16 * wl;
  const int wg_hi = sq.last_tile(row_wg, 64, BK, p.causal);
  const int pair_hi = sq.last_tile(row_pair, DR, BK, p.causal);
  const int min_L_w = row_w + 16 <= Nq ? rule::visible_keys(row_w, Nq, Nk, p.causal) : 0;
  const FwdAnchors anchors = fwd_held_anchors<BK>(p, row_pair, pair_hi, Nq, Nk);  // kSeeded only
  // The test compares each lane's part of the raw row max with a bound per row (rule::skip_bound_raw),
  // recomputed after each retained tile: one comparison per row on the path to the vote.  (This
  // instance runs only for tau > 0: launch_fwd_sm90 runs the dense one at tau = 0.)
  // A seeded split (fwd/common.cuh) starts the bound from its anchor mass and retains the anchor
  // tiles it holds untested.
  float log_thr[1][2], log_norm[1][2], bound[1][2];
  wgmma_fwd_test_inputs(log_thr, log_norm, b, h, row_w, lane, Nq, Nk, p);
  const float inv_scale = 1.f / p.scale_log2;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) bound[0][hh] = rule::skip_bound_raw(log_norm[0][hh], log_thr[0][hh], inv_scale);
  // Lanes counted by the vote (below): pairs, every lane of a pair-0 warp and lane 0 of a pair-1
  // warp; single warps, 2^w lanes of warp w, so that the count is the mask of retaining warps.
  const uint32_t vote_counted = DW == 2 ? (wl < 2 || lane == 0) : lane < (1 << wl);
  uint8_t* mask_row =
      kRecord && wl % DW == 0 ? wgmma_fwd_mask_row(p, b, h, row_pair, DR, pair_hi, lane) : nullptr;
  float m[1][2], l[1][2], acc[1][DT][4];
  softmax_init<1, DT>(m, l, acc);
  float(&acc_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&acc[0][0][0]);
  // O's zeros pinned here, before the first S is issued: left free, ptxas sinks them to just before
  // the loop's first P V, with an S in flight, and then serialises every wgmma (C7515).
  wgmma_fence_operands(acc_flat);
  int retained = 0;
  const uint32_t sQ = sbase + offsetof(Sm, q) + wg * QTile::kBytes;
  uint32_t qreg[C::kQSmem ? 1 : KS][4];
  wgmma_fwd_load_q<QTile, KS, !C::kQSmem>(sQ, sq, p, row_wg, wg, wl, lane, qreg);
  using STile = float[1][NT][4];
  using SFlat = float[BK / 2];
  float sA[1][NT][4], sB[1][NT][4], mx[1][2];
  uint32_t pa[BK / 16][4];
  auto issue_s = [&](int t, STile& s) {
    SFlat& s_flat = *reinterpret_cast<SFlat*>(&s[0][0][0]);
#pragma unroll
    for (int e = 0; e < BK / 2; ++e) s_flat[e] = 0.f;
    const uint32_t slot = ring(t, NKB);
    mbar_wait<true>(kring.full(slot), phase(t, NKB));
    wgmma_fence();
    wgmma_fwd_issue_s<BK, KS, C::kQSmem, T, QTile, KVTile>(s_flat, qreg, sQ,
                                                           wgmma_desc(sK0 + slot * KVTile::kBytes, 16, 1024));
  };
  auto release_k = [&](int t) {
    if (lane == 0) kring.release(ring(t, NKB));
  };
  // Each tile in two steps:
  //   decide(t, s, between): its scores complete in s: mask, row max, the test and the pair vote
  //     (tau > 0), with between() run after the vote's barrier and before its result is read (the
  //     tau > 0 loop issues the next S and waits for the previous P V there);
  //   finish(t, s): P and O += P V issued, committed and left in flight; nothing for a tile the
  //     warpgroup skips (no empty group: ptxas closes one with a dummy wgmma after the join, on
  //     both paths, and the wait for the next S then waits for P V too).  wait_s() then waits for
  //     the S in flight alone either way.
  bool pair_retain = false, wg_any = false;
  auto no_op = [] {};
  auto decide = [&](int t, STile& s, auto&& between) {
    bool lane_retain = false;
    if (t <= wg_hi) {
      warp_mask_max<NT>(s, mx, t * BK, min_L_w, row_w, lane, Nq, Nk, p.causal);
      if constexpr (!kDense) lane_retain = lane_rows_block_skip_raw<1>(mx, bound);
      if constexpr (kSeeded) lane_retain = lane_retain || fwd_forced_tile(anchors, t);
    }
    if constexpr (kDense) {
      (void)lane_retain;
      // The row max reduced over the quad before between(): its shuffles then overlap the next S's
      // issue and the wait for P V, not the exponentials' start.
      quad_row_max<1>(mx);
      between();
      pair_retain = t <= pair_hi;
      wg_any = t <= wg_hi;
    } else {
      // The pair vote in one barrier (pair_vote_popc, attn/skip.cuh: one barrier instead of
      // flags in shared memory and a named barrier): a retaining warp of pair 0 counts 32 (every
      // lane), one of pair 1 counts 1 (lane 0), so the warpgroup's count says both pairs'
      // decisions (single-warp decision tiles: warp w counts 2^w).  The warpgroup's decision, the
      // one branch here, goes through __any_sync, which ptxas knows to be warp-uniform: it then
      // compiles the branch around P V without divergence handling.
      const uint32_t cnt = pair_vote_popc(wg + 1, 128, lane_retain, vote_counted);
      // The row max reduced over the quad while the barrier resolves (bar.red defers blocking to the
      // read of its result), for every tile: it hides the barrier's latency where tiles are
      // retained.  (The new maxima and alpha placed here too: ptxas sinks them behind the branch.)
      quad_row_max<1>(mx);
      between();
      // pair_retain is data below (softmax_step_or_keep), not a branch: no vote for it.
      pair_retain = DW == 2 ? (cnt & (pair ? 31u : ~31u)) != 0u : ((cnt >> wl) & 1u) != 0u;
      wg_any = __any_sync(0xffffffffu, cnt != 0u);
      smem_store_arrive_if(s_dec_addr + 4 * (2 * ring(t, R) + wg), (t << 1) | (wg_any ? 1 : 0),
                           mb_dec + 8 * ring(t, R), (ctid & 127) == 0);  // for the producer's V_t
    }
    if (kRecord && mask_row && lane == 0 && t <= pair_hi) mask_row[t] = pair_retain ? kTileRetained : kTileSkipped;
  };
  auto finish = [&](int t, STile& s) {
    const uint32_t vslot = ring(t, NVB);
    if (wg_any) {
      if constexpr (kDense) {
        if (pair_retain) {
          softmax_step_or_keep<1, NT, DT, false>(s, mx, p.scale_log2, true, m, l, acc);
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk) p_to_a<T, 1, NT>(s, 0, kk, pa[kk]);
          ++retained;
        } else {
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
        }
      } else {
        // One path for both pairs of a warpgroup that runs P V: a skipped pair's rows get P = 0
        // and keep m, l, acc and their bound bit for bit (softmax_step_or_keep), instead of a
        // branch on the pair's decision and zeros for P, which cost more than the exponentials of
        // such rows (they run beside the retaining pair's, in the same warpgroup step).
        softmax_step_or_keep<1, NT, DT>(s, mx, p.scale_log2, pair_retain, m, l, acc);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          bound[0][hh] = fwd_row_bound<kSeeded>(p, b, h, row_w + (lane >> 2) + 8 * hh, Nq, m[0][hh], l[0][hh],
                                                log_thr[0][hh], inv_scale);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) p_to_a<T, 1, NT>(s, 0, kk, pa[kk]);
        retained += pair_retain ? 1 : 0;
      }
      mbar_wait<true>(vring.full(vslot), phase(t, NVB));
      wgmma_fence();
      const uint64_t dV = wgmma_desc(sV0 + vslot * KVTile::kBytes, KVTile::kBlockBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) WgmmaRS<D, 1, T>::run(acc_flat, pa[kk], wgmma_desc_advance(dV, kk * 2048));
      wgmma_commit();
    }
  };
  auto wait_s = [&]() {
    if (wg_any) {
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
  };
  // Once finish(t)'s group has completed: O is final for the tile, and the V slot of tile t + 2 is
  // given back.  Every warp gives back every tile's slot, once the producer has completed the tile's
  // full barrier (so that a warpgroup that skips tiles cannot run a phase ahead of the producer's
  // wait on the empty barrier), two tiles late (so that a warpgroup waits for the other's on-demand
  // V only if it lags two tiles behind).
  auto pv_done = [&](int t) {
    wgmma_fence_operands(acc_flat);
    if (t + 2 <= top) {
      const uint32_t rs = ring(t + 2, NVB);
      mbar_wait<true>(vring.full(rs), phase(t + 2, NVB));
      if (lane == 0) vring.release(rs);
    }
  };
  auto s_done = [&](STile& s) { wgmma_fence_operands(*reinterpret_cast<SFlat*>(&s[0][0][0])); };
  if (n_tiles > 0) {
    // Per tile t (decided; S(t - 1) in flight into s_n): finish(t) (its exponentials run while
    // S(t - 1) is on the tensor cores, P V(t) left in flight), then decide(t - 1), whose between()
    // issues S(t - 2) behind P V(t) and waits for P V(t) alone, so that the tensor cores always hold
    // the next product and, at tau > 0, the vote's latency hides behind both.  (Waiting for P V(t)
    // before S(t - 2) is issued leaves the tensor cores idle in between, at every tau.)
    auto step = [&](int t, STile& s_t, STile& s_n) {  // t >= 2
      finish(t, s_t);
      wait_s();
      s_done(s_n);
      release_k(t - 1);
      decide(t - 1, s_n, [&] {
        issue_s(t - 2, s_t);
        wgmma_commit();
        wgmma_wait<1>();
        pv_done(t);
      });
    };
    auto step_to_0 = [&](STile& s_1, STile& s_0) {  // t = 1
      finish(1, s_1);
      wait_s();
      s_done(s_0);
      release_k(0);
      decide(0, s_0, [&] {
        wgmma_wait<0>();
        pv_done(1);
      });
    };
    issue_s(top, sA);
    wgmma_commit();
    wgmma_wait<0>();
    s_done(sA);
    release_k(top);
    if (top == 0) {
      decide(0, sA, no_op);
      finish(0, sA);
    } else {
      decide(top, sA, [&] {
        issue_s(top - 1, sB);
        wgmma_commit();
      });
      // Whole steps only (no wgmma under a branch inside the loop, which makes ptxas serialise them).
      int t = top;
      for (; t >= 3; t -= 2) {
        step(t, sA, sB);
        step(t - 1, sB, sA);
      }
      if (t == 2) {
        step(2, sA, sB);
        step_to_0(sB, sA);
        finish(0, sA);
      } else {
        step_to_0(sA, sB);
        finish(0, sB);
      }
    }
    wgmma_wait<0>();
    pv_done(0);
  }
  if constexpr (kDense) softmax_quad_row_sums<1>(l);
  fwd_epilogue<T, 1, DT>(p, sq, b, h, row_w, lane, m, l, acc, retained * BK);
#endif
}

// Launches the instance (dense, record, seeded) names (grid: query tiles of 128 rows, heads, batch).
template <typename T, int D>
cudaError_t launch_fwd_sm90_ws(const FwdParams& p, bool dense, bool record, bool seeded, const CUtensorMap& tk,
                               const CUtensorMap& tv, cudaStream_t stream) {
  using C = FwdWs<D>;
  auto kernel = mala_fwd_kernel_sm90_ws<T, D, false, false, false>;
  if (dense) kernel = record ? mala_fwd_kernel_sm90_ws<T, D, true, true, false> : mala_fwd_kernel_sm90_ws<T, D, true, false, false>;
  else if (seeded) kernel = record ? mala_fwd_kernel_sm90_ws<T, D, false, true, true> : mala_fwd_kernel_sm90_ws<T, D, false, false, true>;
  else if (record) kernel = mala_fwd_kernel_sm90_ws<T, D, false, true, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err != cudaSuccess) return err;
  dim3 grid(rule::ceil_div(p.seqlen_q, C::BQ), p.heads_q, p.batch);
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(p, tk, tv);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

// The 128-key forward on Hopper (wgmma + TMA), every head dim, sm_90a: every tau wherever the TMA
// can describe K and V (fwd/dispatch.cu).  Its decision tile is kDecRows query rows x BK keys (BK:
// 128, 64 at d = 256, where Q stays in shared memory; kDecRows: a warp's 16 rows at d = 128, a warp
// pair's 32 at d = 64 and 256), one test and one vote per key tile (forward_tiles reports it).  Two
// 32 x 64 decisions per 128-key tile cost more than 64-key tiles save: the second test waits for the
// first half's exponentials (docs/kernels.md, "128-key forward").
//
// A CTA is three warpgroups over 128 query rows (causal: the longest query tiles first):
//   producer (warpgroup 0, 24 registers; one thread issues every TMA load): K(t) and V(t) into rings
//     of kStages slots (full/empty mbarriers), in the consumers' order: K(top), then K(t - 1)
//     before V(t).  Dense, and d = 64 (FwdK128::kVSkip): V(t) always.  tau > 0: V(t) at once
//     while the newest decision the consumers have published (read without waiting; each warp at
//     d = 128, each warpgroup otherwise, publishes per tile whether it runs it, through a ring of 8
//     slots) says some ran; otherwise it waits for tile t's decisions and loads V(t) only where
//     some warp runs it, else completes the slot's full barrier with a plain arrival (no bytes).  A
//     producer that always waited for the decision was slower where every tile is kept: it stalled
//     V behind every vote (docs/journal.md).
//   consumers (warpgroups 1 and 2, 240 registers, 64 rows each; Q in registers, at d = 256 in shared
//     memory): per key tile, from the diagonal down,
//       issue S(t - 1) = Q K(t - 1)^T; at d = 128 the warpgroup's vote on tile t (one bar.red.or,
//         whose wait overlaps S(t - 1)); where the warpgroup runs tile t, O += P(t) V(t) (P(t)
//         packed in registers, 0 for a warp or pair that skips it);
//       once S(t - 1) is complete: mask, row max, at tau > 0 the test (each lane's part of the raw
//         row max against a bound per row) and the vote (d = 128: the warp's own, so nothing waits
//         for another warp before the exponentials; otherwise the pair vote, one bar.red.popc per
//         warpgroup), then, where the warp (pair vote: the warpgroup) runs the tile,
//         P(t - 1) = exp2(S - m) with the lazy rescale's base (its exponentials run while P V(t) is
//         on the tensor cores);
//       once P V(t) is complete: O rescaled where a row's base moved, P(t - 1) packed.
//   One S accumulator and one packed P per thread (64 + 32 registers at 128 keys) instead of two S
//   accumulators: what lets 128-key tiles fit beside O and Q.
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
struct FwdK128 {
  static constexpr int D = D_;
  static_assert(fwd_has_sm90_k128(D), "128-key forward: head dims 64, 128 and 256 (fwd/params.h)");
  static constexpr FwdTiles kTiles = fwd_tiles(FwdKernelKind::sm90_k128, D);  // fwd/tiles.h
  static constexpr int kThreads = 384, BQ = kTiles.bq, BK = kTiles.bk;
  // d = 256: O takes 128 registers a thread, which leaves none for Q's 64; Q stays in shared memory
  // (an operand of an ss wgmma).
  static constexpr bool kQSmem = D == 256;
  // The decision tile: kDecRows x BK.  d = 128: a warp's 16 rows, and the warpgroup's vote on whether
  // to run P V waits until the next S is issued (kWarpVote).  d = 64 and 256: a warp pair's 32 rows,
  // voted on before the exponentials; per-warp decisions there ran slower on random inputs, where
  // every tile is kept (docs/journal.md).
  static constexpr int kDecRows = kTiles.dec_rows;
  static constexpr bool kWarpVote = kTiles.dec_warps == 1;
  using QTile = std::conditional_t<kQSmem, GmmaTile<64, D>, SmemTile<64, D>>;
  using KVTile = GmmaTile<BK, D>;
  // K and V rings: 3 x (32 + 32) KB at d = 128 (224 KB with Q), 4 x (16 + 16) KB at d = 64.  One slot
  // fewer ran slower at both head dims (docs/journal.md).
  static constexpr int kStages = kTiles.k_stages;
  static_assert(kTiles.v_stages == kStages, "K and V share one ring index");
  // tau > 0 only: the decision ring for the producer's V loads, kDecSlots mbarriers (one arrival per
  // publisher: each consumer warp where kWarpVote, else each consumer warpgroup) and kDecSlots flag
  // words of 8 bytes, as the mbarriers are (byte i: whether publisher i retains the tile; one offset
  // addresses both).
  // kDecSlots >= kStages + 2 keeps a slot from being reused before the producer has read it (the
  // consumers run at most kStages + 1 uses ahead of the producer's reads: see the producer).
  // kVSkip: whether V waits on the decision at tau > 0.  Not at d = 64, where a tile's products are
  // short: there the decision ring cost more where every tile is kept than it saved where few are
  // (docs/kernels.md, "V after a skip").
  static constexpr bool kVSkip = kTiles.v_skip;
  static constexpr int kDecSlots = 8;  // a power of 2
  static constexpr int kPublishers = kWarpVote ? 8 : 2;
  static_assert(kDecSlots >= kStages + 2, "decision ring: a slot reused before the producer read it");
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char k[kStages][KVTile::kBytes];
    unsigned char v[kStages][KVTile::kBytes];
    unsigned char q[2][QTile::kBytes];  // one per consumer warpgroup
    uint64_t mbar[4 * kStages];         // full_k, empty_k, full_v, empty_v [kStages]
    uint64_t dec[kDecSlots];            // the decision ring: only in kSmemRing
    uint8_t dec_flag[kDecSlots][8];
  };
  static_assert(offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, q) % 1024 == 0 &&
                    QTile::kBytes % 1024 == 0,
                "FwdK128::Storage: swizzled tiles at 1024-byte boundaries");
  // + the base's alignment; kSmem: no decision ring (dense, or no V skip)
  static constexpr int kSmem = offsetof(Storage, dec) + 1024, kSmemRing = sizeof(Storage) + 1024;
};

// kDense: tau = 0 (no test, no vote; every legal tile retained).  kSeeded: a seeded split
// (FwdParams::seed_lse, fwd/common.cuh): the test's denominator starts from the anchor mass and the
// anchor tiles the split holds are retained untested.  kRecord (tau > 0): the instance for calls
// that ask for the tile mask or the slots; the others carry no per-tile code for them (the mask's
// predicated store and the retained count: 11 instructions a warp per tile, 8 of them between the
// vote and the exponentials).  The dense instance records after its loop and always has it.
template <typename T, int D, bool kDense, bool kSeeded, bool kRecord>
__global__ void __launch_bounds__(384, 1)
    mala_fwd_kernel_sm90_k128(const FwdParams p, const __grid_constant__ CUtensorMap tmap_k,
                              const __grid_constant__ CUtensorMap tmap_v) {
#ifdef MALA_WGMMA_ENABLED
  static_assert(!(kDense && kSeeded), "a seeded split tests");
  static_assert(kRecord || !kDense, "the dense instance records after its loop");
  using C = FwdK128<D>;
  constexpr int BQ = C::BQ, BK = C::BK, NT = BK / 8, DT = D / 8, KS = D / 16, NS = C::kStages;
  using QTile = typename C::QTile;
  using KVTile = typename C::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* const smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x, b = blockIdx.z, h = blockIdx.y;
  const int qtile = longest_first_query_tile(p.causal);
  const FwdSeq<T> sq = fwd_seq<T>(p, b, h);
  const int Nq = sq.Nq, Nk = sq.Nk;
  const int row_cta = qtile * BQ;
  // Tiles are visited from `top` down; tile t is the (top - t)-th use of the rings.
  const int n_tiles = sq.key_tiles(row_cta, BQ, BK, p.causal);
  const int top = n_tiles - 1;
  using Sm = typename C::Storage;
  Sm& st = *reinterpret_cast<Sm*>(smem);
  const uint32_t sK0 = sbase + offsetof(Sm, k), sV0 = sbase + offsetof(Sm, v);
  // The K ring's full and empty mbarriers, then the V ring's.
  const MbarRing<NS> kring = MbarRing<NS>::at(sbase + offsetof(Sm, mbar)), vring = MbarRing<NS>::at(kring.empty0 + 8 * NS);
  // tau > 0: use u's decision in slot u % kDecSlots, phase parity (u / kDecSlots) & 1; flags [slot][wg].
  constexpr int ND = C::kDecSlots;
  // The K ring's base for issue_s (below), which waits through MbarRing<NS>::at(k_mbar): a step
  // that captures the ring itself instead reorders the phi nodes of kr and vr in the PTX, which
  // reaches ptxas's schedule in 7 of the 15 instances (the SROA order of the kernel's locals).
  const uint32_t k_mbar = kring.full0;
  const uint32_t mb_dec = sbase + offsetof(Sm, dec);
  volatile uint8_t* const s_dec = &st.dec_flag[0][0];
  if (tid == 0) {
    for (int i = 0; i < NS; ++i) {
      kring.init_slot(i, 1, 8);  // the producer's arrival; one arrival per consumer warp
      vring.init_slot(i, 1, 8);
    }
    if constexpr (!kDense && C::kVSkip)
      for (int i = 0; i < C::kDecSlots; ++i) mbar_init(mb_dec + 8 * i, C::kPublishers);
    fence_mbarrier_init();
  }
  __syncthreads();
  const int hk = h / p.group;
  const int k_row0 = sq.k_off, k_batch = p.cu_k ? 0 : b;  // varlen maps the packed rows as one batch entry
  if (tid < 128) {  // producer warpgroup: one thread issues every load
    setmaxnreg_dec24();
    if (tid == 0 && n_tiles > 0) {
      auto load = [&](uint32_t s0, const CUtensorMap* map, const MbarRing<NS>& ring, int i) {
        const RingPos r = RingPos::at<NS>(i);
        if (i >= NS) ring.producer_wait(r);
        tma_load_tile<BK, D>(s0 + r.slot * KVTile::kBytes, map, ring.full(r.slot), k_row0 + (top - i) * BK, hk, k_batch);
      };
      load(sK0, &tmap_k, kring, 0);
      if constexpr (kDense || !C::kVSkip) {
        for (int i = 0; i <= top; ++i) {
          if (i < top) load(sK0, &tmap_k, kring, i + 1);
          load(sV0, &tmap_v, vring, i);
        }
      } else {
        // V(i) (use i) at once while the newest decision published so far (read without waiting)
        // says some publisher retained; otherwise once use i's own decision is out, and only if some
        // publisher retains it (its warpgroup then runs P V): else the slot's full barrier completes
        // with a plain arrival (no bytes), so the consumers' waits and the ring's phases are as with a
        // load.  Nobody reads the slot.
        // Progress: a publisher publishes use i's decision after waiting only for K(<= i),
        // V(<= i - 1) and its warpgroup's other warps at a vote (on use i, or with kWarpVote on use
        // i - 1; above its first tile: after K(i), before V(i)), all issued before V(i) here.
        // Ring (ND slots): use u's decision is published only once K(u) is full.  `seen` (the next
        // decision to read) is > i - NS after V(i)'s empty wait (every consumer warp gives V(i - NS)
        // back after its publisher published use i - NS's decision), and during step i no decision
        // past use i + 1 can be out (K(i + 1) is the newest K issued): a slot read in step i (use
        // >= i - NS) is not reused while ND >= NS + 2, and use u - ND's phase has completed before
        // use u's is tested (parity waits are exact).  One publisher cannot arrive twice on a slot
        // before every other arrived once: it publishes use u + ND after K(u + ND), issued after
        // every consumer warp gave K(u + ND - NS) back, by which time each publisher had published
        // use u (ND >= NS + 1).
        // Use u's decision: slot u % ND, phase parity (u / ND) & 1; whether some publisher retains it.
        auto dec_bar = [&](uint32_t u) { return mb_dec + 8 * (u % ND); };
        auto dec_run = [&](uint32_t u) {
          if constexpr (C::kWarpVote)
            return *reinterpret_cast<volatile uint64_t*>(s_dec + 8 * (u % ND)) != 0;
          else
            return *reinterpret_cast<volatile uint16_t*>(s_dec + 8 * (u % ND)) != 0;
        };
        uint32_t seen = 0;
        bool last = true;  // nothing decided yet: load
        for (int i = 0; i <= top; ++i) {
          if (i < top) load(sK0, &tmap_k, kring, i + 1);
          const RingPos r = RingPos::at<NS>(i);
          if (i >= NS) vring.producer_wait(r);
          for (; seen <= static_cast<uint32_t>(i) && mbar_test(dec_bar(seen), (seen / ND) & 1u); ++seen)
            last = dec_run(seen);
          if (!last) {
            mbar_wait<true>(dec_bar(i), (static_cast<uint32_t>(i) / ND) & 1u);
            last = dec_run(i);
            seen = i + 1;
          }
          const uint32_t full = vring.full(r.slot);
          if (last)
            tma_load_tile<BK, D>(sV0 + r.slot * KVTile::kBytes, &tmap_v, full, k_row0 + (top - i) * BK, hk, k_batch);
          else
            vring.fill_empty(r.slot);
        }
      }
    }
    return;
  }
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
  const uint32_t sQ = sbase + offsetof(Sm, q) + wg * QTile::kBytes;
  uint32_t qreg[C::kQSmem ? 1 : KS][4];
  wgmma_fwd_load_q<QTile, KS, !C::kQSmem>(sQ, sq, p, row_wg, wg, wl, lane, qreg);
  using SFlat = float[BK / 2];
  float s[1][NT][4], mx[1][2];
  SFlat& s_flat = *reinterpret_cast<SFlat*>(&s[0][0][0]);
  uint32_t pa[BK / 16][4];
  RingPos kr{0, 0u}, vr{0, 0u};
  // tau > 0: whether this warp (kWarpVote: lane 0 of each warp) or this warpgroup (its thread 0)
  // runs tile t, for the producer, published once S(t) is decided and before V(t) is waited for.
  // Predicated in PTX rather than branched around: a branch on lane == 0 costs a BSSY/BSYNC pair.
  const uint32_t publisher = lane == 0 && (C::kWarpVote || wl == 0);
  const int pub_index = C::kWarpVote ? warp : wg;
  auto publish = [&](int t, bool retain) {
    if constexpr (!kDense && C::kVSkip) {
      const uint32_t u8 = static_cast<uint32_t>(top - t) % ND * 8;
      asm volatile(
          "{\n .reg .pred p;\n .reg .b64 st;\n setp.ne.u32 p, %0, 0;\n @p st.shared.u8 [%1], %2;\n"
          " @p mbarrier.arrive.shared.b64 st, [%3];\n}\n" ::"r"(publisher),
          "r"(sbase + static_cast<uint32_t>(offsetof(Sm, dec_flag)) + pub_index + u8), "r"(retain ? 1u : 0u), "r"(mb_dec + u8)
          : "memory");
    }
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
  int slots;
  if constexpr (kDense) {
    softmax_quad_row_sums<1>(l);
    // Every legal tile of the decision tile retained.
    if (mask_row)
      for (int kt = lane; kt <= dec_hi; kt += 32) mask_row[kt] = kTileRetained;
    slots = (dec_hi + 1) * BK;
  } else {
    slots = retained * BK;  // 0 where !kRecord: the call asked for no slots
  }
  fwd_epilogue<T, 1, DT>(p, sq, b, h, row_w, lane, m, l, acc, slots);
#endif
}

// Launches the instance (dense, record, seeded) names (grid: query tiles of 128 rows, heads, batch).
// The tensor maps' boxes are FwdK128<D>::BK rows.
template <typename T, int D>
cudaError_t launch_fwd_sm90_k128(const FwdParams& p, bool dense, bool record, bool seeded, const CUtensorMap& tk,
                                 const CUtensorMap& tv, cudaStream_t stream) {
  using C = FwdK128<D>;
  auto kernel = dense    ? mala_fwd_kernel_sm90_k128<T, D, true, false, true>
                : seeded ? (record ? mala_fwd_kernel_sm90_k128<T, D, false, true, true>
                                   : mala_fwd_kernel_sm90_k128<T, D, false, true, false>)
                         : (record ? mala_fwd_kernel_sm90_k128<T, D, false, false, true>
                                   : mala_fwd_kernel_sm90_k128<T, D, false, false, false>);
  const int smem = !dense && C::kVSkip ? C::kSmemRing : C::kSmem;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  dim3 grid(rule::ceil_div(p.seqlen_q, C::BQ), p.heads_q, p.batch);
  kernel<<<grid, C::kThreads, smem, stream>>>(p, tk, tv);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

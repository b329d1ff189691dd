// The warp-specialized backward on Hopper (wgmma + TMA), head dims 64 and 128, sm_90a: the kernel for
// every tau whenever the TMA can describe Q, dO, K, V and the dQ accumulator (dispatch.cu; varlen
// calls when they give total_q and total_k).  Same work split, tile order, offline test, vote and
// outputs as the mma.sync kernel (kernel_sm80.cuh) -- one CTA per (key tile of 128 keys,
// sequence, KV head, head split), query tiles of 64 rows ascending from the first legal one, dK/dV in
// registers -- so the tile mask, the slots and the gradients are its (up to the order of dQ's adds).
//
// Three warpgroups (384 threads):
//   producer (warpgroup 0, 24 registers):
//     warp 0  K and V once, then Q_t with its rows' lse, skip bound (and in the deterministic mode
//             the rows' dQ units) into a ring of kQStages slots (one thread issues every TMA load;
//             full/empty mbarriers);
//     warp 1  dO_t with D = rowsum(dO * O) into a ring of 2 slots: speculatively when tile t - 2 was
//             retained (always at tau = 0), else once the consumers have decided tile t, and only if
//             they retain it.  The slot's full barrier completes once per tile either way (with no
//             bytes when dO_t is not loaded), so every phase is static;
//     warp 2  dQ writer: adds each retained tile's dQ (64 x d in shared memory: fp32, or in the
//             deterministic mode the int32 of BwdParams::dq_fixed, whose sums do not depend on the
//             order of the adds) into the dQ accumulator with one TMA reduce-add per 128-byte column
//             box, off the consumers' path (a buffer handed over through a full and an empty mbarrier).
//   consumers (warpgroups 1 and 2, 240 registers; warpgroup g owns keys 64g..64g+63 of the tile):
//     S^T_g  = K_g Q^T                 (dP^T_g = V_g dO^T right behind it when dO_t is expected)
//     mask, offline test against each row's raw-score bound, CTA vote (tau > 0)
//     P^T = exp2(S^T - lse), dS^T = P^T (dP^T - D)      in registers
//     dS^T -> shared memory;  dV_g += P^T dO,  dK_g += dS^T Q    (A from registers)
//     both warpgroups' dS^T stored (named barrier): dQ[:, (D/2)g..] = dS K, then dK
//     (dQ goes to the writer while dK runs)
//     dQ -> shared memory (swizzled, conflict-free) for the writer.
//   A skipped tile stops after S^T: it releases its Q slot and issues no dP^T, dV, dK or dQ work.
//   With the forward's tile mask (kFwdMask), a tile none of whose forward tiles was retained is
//   skipped before S^T: no Q or dO load, no vote (the offline test would skip it: spec.md).
#pragma once

#include <stddef.h>
#include <type_traits>

#include "cuda/bwd/common.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/tma.cuh"
#include "cuda/core/wgmma.cuh"

namespace mala {
namespace cuda {

// kDet: the fixed-point deterministic mode (int32 dQ in the fp32 buffer's layout, and the rows' units).
template <int D_, bool kDet_ = false>
struct BwdWs {
  static constexpr BwdTiles kTiles = bwd_tiles(BwdKernelKind::sm90_ws, D_);  // bwd/tiles.h
  static constexpr int D = D_, BQ = kTiles.bq, BK = kTiles.bk, kThreads = 384;
  static constexpr bool kDet = kDet_;
  static constexpr int kQStages = kTiles.q_stages;
  static_assert(D == 64 || D == 128, "warp-specialized backward: head dim 64 or 128");
  using KTile = GmmaTile<BK, D>;
  using QTile = GmmaTile<BQ, D>;
  using STile = GmmaTile<BK, BQ>;            // dS^T [key][query]
  // dQ (fp32 or int32) in boxes of 128 bytes x 64 rows: 32 columns each.
  static constexpr int kDqBoxCols = 32, kDqBoxes = D / kDqBoxCols;
  static constexpr int kDqBytes = BQ * 128 * 4;  // (room for 4 boxes at d = 64)
  // The per-row scalars of a query tile (lse in log2 units, the skip bound, D) arrive by TMA as kVec
  // floats from the 16-byte boundary at or before the tile's first row (a box must start there): the
  // tile's rows begin (row & 3) floats in.  kVecStride floats per slot (a box lands 128-byte aligned).
  static constexpr int kVec = BQ + 4, kVecStride = 96;
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char k[KTile::kBytes];
    unsigned char v[KTile::kBytes];
    unsigned char q[kQStages][QTile::kBytes];
    unsigned char dout[2][QTile::kBytes];
    // One dS^T buffer: before a warpgroup writes a tile's dS^T, the dQ writer's full barrier has
    // completed the last post, which both warpgroups make only once their dQ products (which read
    // dS^T) are complete.  (The space went to a fourth Q stage, which the skip path, loading nothing
    // else, runs on.)
    unsigned char ds[STile::kBytes];
    unsigned char dq[kDqBytes];
    float lse[kQStages][kVecStride];
    float bound[kQStages][kVecStride];
    float dsum[2][kVecStride];
    float unit[kDet ? kQStages : 0][kVecStride];  // kDet only (no bytes otherwise)
    // kv_full, q_full[kQStages], q_empty[kQStages], do_full[2], do_empty[2], vote[4], dq_full,
    // dq_empty, dec[8] (rounded up to 16 bytes)
    uint64_t mbar[(19 + 2 * kQStages + 1) / 2 * 2];
    uint32_t vote[4];  // tagged vote words
    int dec[8];        // (u << 1) | retained, for the dO producer (the u-th scored tile in slot u % 8,
                       // published through mbarrier dec[u % 8])
    int dq_row[4];     // to the dQ writer: the tile's first accumulator row (-1: no more tiles)
    // forward_tile_mask: bit t of the CTA's tiles in the visiting order, whether tile t is scored
    // (some forward tile inside it retained); up to kBwdWsScoredTiles tiles (dispatch.cu passes the
    // mask only then).
    uint32_t scored[kBwdWsScoredTiles / 32];
  };
  static_assert(offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, q) % 1024 == 0 &&
                    offsetof(Storage, dout) % 1024 == 0 && offsetof(Storage, ds) % 1024 == 0 &&
                    offsetof(Storage, dq) % 1024 == 0,
                "BwdWs::Storage: swizzled tiles and dQ boxes at 1024-byte boundaries");
  static_assert(offsetof(Storage, lse) % 128 == 0 && (kVecStride * 4) % 128 == 0,
                "BwdWs::Storage: TMA boxes of the scalars at 128-byte boundaries");
  static constexpr int kSmem = sizeof(Storage) + 1024;  // + the base's alignment
  // Named barriers of the consumers (0 is __syncthreads): both warpgroups' dS^T stored; the vote after
  // a skipped tile (barrier_vote_or).
  static constexpr int kBarDs = 1, kBarVote = 2, kConsumers = 256;
};

// kFwdMask (tau > 0): the instance for calls with forward_tile_mask (BwdParams::fwd_mask); kDet: for
// calls with fixed-point dQ (BwdParams::dq_fixed).  The other instances carry none of their code.
template <typename T, int D, bool kDense, bool kFwdMask, bool kDet>
__global__ void __launch_bounds__(384, 1)
    bwd_main_kernel_sm90_ws(const BwdParams p, const __grid_constant__ BwdTmaMaps maps) {
#ifdef MALA_WGMMA_ENABLED
  using C = BwdWs<D, kDet>;
  constexpr int BQ = C::BQ, BK = C::BK, NQS = C::kQStages;
  using KTile = typename C::KTile;
  using QTile = typename C::QTile;
  using STile = typename C::STile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x;

  const BwdWork w = bwd_cta_work<BQ, BK>(p);
  if (w.kb >= w.klen) return;
  const int qlen = w.qlen, klen = w.klen, kb = w.kb, kn = w.kn, n_iter = w.n_iter;

  using Sm = typename C::Storage;
  const uint32_t sK = sbase + offsetof(Sm, k), sV = sbase + offsetof(Sm, v), sQ = sbase + offsetof(Sm, q),
                 sDO = sbase + offsetof(Sm, dout), sDS = sbase + offsetof(Sm, ds), sDQ = sbase + offsetof(Sm, dq);
  const uint32_t mb_kv = sbase + offsetof(Sm, mbar);
  const MbarRing<NQS> qring = MbarRing<NQS>::at(mb_kv + 8);
  const MbarRing<2> doring = MbarRing<2>::at(qring.empty0 + 8 * NQS);
  const uint32_t mb_vote = doring.empty0 + 16, mb_dq_full = mb_vote + 32, mb_dq_empty = mb_dq_full + 8,
                 mb_dec = mb_dq_empty + 8;
  uint32_t* vote_w = reinterpret_cast<uint32_t*>(smem + offsetof(Sm, vote));
  volatile int* s_dec = reinterpret_cast<volatile int*>(smem + offsetof(Sm, dec));
  volatile int* s_dq_row = reinterpret_cast<volatile int*>(smem + offsetof(Sm, dq_row));
  // kFwdMask: tiles that no forward tile inside was retained in are skipped unscored.
  static_assert(!(kDense && kFwdMask), "the forward's mask serves tau > 0");
  if (tid == 0) {
    mbar_init(mb_kv, 2);  // K's and V's expect_tx arrivals
    qring.init(1, 8);   // the producer's expect_tx arrival; one arrival per consumer warp
    doring.init(1, 8);
    mbar_init(mb_dq_full, 8);   // each consumer warp, once its part of the dQ tile is stored
    mbar_init(mb_dq_empty, 1);  // the writer, once the TMA has read the buffer
    for (int i = 0; i < 8; ++i) mbar_init(mb_dec + 8 * i, 1);  // tile t's decision (one consumer thread)
    for (int i = 0; i < 4; ++i) {
      mbar_init(mb_vote + 8 * i, 8);
      vote_w[i] = 0u;
    }
    fence_mbarrier_init();
  }
  const uint32_t* scored_bits = reinterpret_cast<const uint32_t*>(smem + offsetof(Sm, scored));
  if constexpr (kFwdMask) {  // the whole CTA: one 32-tile word per warp at a time
    const int warp = tid >> 5, lane = tid & 31;
    for (int k = warp; 32 * k < n_iter; k += C::kThreads / 32) {
      const uint32_t bits = bwd_forward_retained32<BQ, BK>(p, w, 32 * k, lane);
      if (lane == 0) reinterpret_cast<uint32_t*>(smem + offsetof(Sm, scored))[k] = bits;
    }
  }
  __syncthreads();
  // A CTA that would score most of its tiles anyway scores them all, as without the mask: the skips
  // could save at most the S^T of the few tiles left out, and a CTA that steps over scattered
  // unscored tiles ran slower than one that scored them (docs/kernels.md).  Each warp counts the
  // bits, a word per lane.
  bool use_fwd_mask = kFwdMask;
  if constexpr (kFwdMask) {
    int n_scored = 0;
    for (int k = tid & 31; 32 * k < n_iter; k += 32) n_scored += __popc(scored_bits[k]);
    use_fwd_mask = 2 * __reduce_add_sync(0xffffffffu, n_scored) < n_iter;
  }
  // Whether tile t is scored (kFwdMask).
  auto is_scored = [&](int t) { return !use_fwd_mask || ((scored_bits[t >> 5] >> (t & 31)) & 1u) != 0u; };

  // TMA coordinates of this sequence's row 0: varlen maps the packed rows as one batch entry.
  const int q_row0 = w.varlen ? static_cast<int>(w.qrow0) : 0, k_row0 = w.varlen ? static_cast<int>(w.krow0) : 0;
  const int map_b = w.varlen ? 0 : w.b;
  // Phase parity of the k-th use of a ring slot (k = t / slots).
  auto parity = [](int use) { return static_cast<uint32_t>(use) & 1u; };

  if (tid < 128) {
    setmaxnreg_dec24();
    const int warp = tid >> 5, lane = tid & 31;
    if (warp == 0) {
      if (lane == 0) {
        tma_load_tile<BK, D>(sK, &maps.k, mb_kv, k_row0 + kb, w.hk, map_b);
        tma_load_tile<BK, D>(sV, &maps.v, mb_kv, k_row0 + kb, w.hk, map_b);
      }
      BwdWork::Tile x = w.tile(0);
      for (int t = 0, s = 0, use = 0; t < n_iter; ++t, x = w.next(x)) {
        if constexpr (kFwdMask)
          if (!is_scored(t)) continue;
        if (use > 0) mbar_wait<true>(qring.empty(s), parity(use - 1));
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
    } else if (warp == 1) {
      // Tile t's decision, (t << 1) | retained, once the consumers have published it.  (Slot t % 8 is
      // not reused before this warp has read it: the consumers give back every tile's dO slot, so they
      // run at most a few tiles ahead of this warp.)
      auto decision = [&](int t) {
        mbar_wait<true>(mb_dec + 8 * (t & 7), parity(t >> 3));
        return s_dec[t & 7];
      };
      // The rings count scored tiles only (r: u with kFwdMask, else t).
      BwdWork::Tile x = w.tile(0);
      for (int t = 0, u = 0; t < n_iter; ++t, x = w.next(x)) {
        if constexpr (kFwdMask)
          if (!is_scored(t)) continue;
        const int r = kFwdMask ? u++ : t;
        const int s = r & 1;
        if (r >= 2) mbar_wait<true>(doring.empty(s), parity((r >> 1) - 1));
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
            mbar_arrive(full);
          }
        }
      }
    } else if (warp == 2 && lane == 0) {
      // The buffer goes back to the consumers as soon as the TMA has read it.
      for (int k = 0;; ++k) {
        mbar_wait<true>(mb_dq_full, parity(k));
        const int row = s_dq_row[0];  // (read before the arrival that gives the buffer back)
        if (row < 0) break;
#pragma unroll
        for (int b = 0; b < C::kDqBoxes; ++b)
          tma_reduce_add_2d(&maps.dq, sDQ + b * (BQ * 128), C::kDqBoxCols * b, row);
        bulk_commit_group();
        bulk_wait_group_read0();
        mbar_arrive(mb_dq_empty);
      }
      bulk_wait_group0();
    }
    return;
  }

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
    if (n_posts > 0) mbar_wait<true>(mb_dq_empty, parity(n_posts - 1));
  };
  auto post_dq = [&](int row) {
    if (ctid == 0) s_dq_row[0] = row;
    __syncwarp();
    if (lane == 0) mbar_arrive(mb_dq_full);
    ++n_posts;
  };
  // acc (this warpgroup's 64 keys x 64 rows) = X_g Y^T over d, X = K or V, Y = Q or dO; committed.
  auto keys_x_rows = [&](float(&acc)[32], uint32_t sX, uint32_t sY) {
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = 0.f;
    wgmma_fence();
    wgmma_ss_kmajor<64, D, T>(acc, sX + 64 * wg * 128, KTile::kBlockBytes, sY, QTile::kBlockBytes);
    wgmma_commit();
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
      mbar_wait<true>(doring.full(pend_do & 1), parity(pend_do >> 1));
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
    mbar_wait<true>(qring.full(qs), parity(quse_n));
    // This tile's rows in the scalar slots (kVec above).
    const int vec0 = static_cast<int>((x.h() * p.rows_q_cap + w.qrow0 + x.qi() * BQ) & 3);
    const float* bound_t = bound_s + qs * C::kVecStride + vec0;
    // The bounds of this thread's first two query rows, for the retained-tile shortcut below.
    float2 early_bound = make_float2(0.f, 0.f);
    if (!kDense && dp_early) early_bound = make_float2(bound_t[2 * tig], bound_t[2 * tig + 1]);
    keys_x_rows(s, sK, sQ + qs * QTile::kBytes);
    if constexpr (dp_early) {
      mbar_wait<true>(doring.full(ring_t & 1), parity(ring_t >> 1));
      keys_x_rows(dp, sV, sDO + (ring_t & 1) * QTile::kBytes);
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
      mbar_wait<true>(doring.full(ring_t & 1), parity(ring_t >> 1));
      keys_x_rows(dp, sV, sDO + (ring_t & 1) * QTile::kBytes);
    }
    // Retained tile t.  Its dS^T goes into the one buffer once the other warpgroup's dQ products of
    // the last retained tile have read it: both warpgroups post to the writer only after those, so
    // the last post's phase of the writer's full barrier says so.  (The barrier is at most that phase
    // on: the next one needs this warpgroup's own post.)  Waited for here, where dP^T still runs.
    if (n_posts > 0) mbar_wait<true>(mb_dq_full, parity(n_posts - 1));
    const int ds = ring_t & 1, h = x.h(), q0 = x.qi() * BQ;
    const uint32_t sQs = sQ + qs * QTile::kBytes, sDOs = sDO + ds * QTile::kBytes;
    const float* unit_t = reinterpret_cast<const float*>(smem + offsetof(Sm, unit)) + qs * C::kVecStride + vec0;
    // P = exp2(S - lse) while dP^T is computed.
    const float* lse_t = lse_s + qs * C::kVecStride + vec0;
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
    const float* dsum_t = dsum_s + ds * C::kVecStride + vec0;
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
    for (int kq = 0; kq < 4; ++kq)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pa[kq][i] = pack2<T>(s[8 * kq + 2 * i], s[8 * kq + 2 * i + 1]);
        da[kq][i] = pack2<T>(dp[8 * kq + 2 * i], dp[8 * kq + 2 * i + 1]);
      }
    // dS^T -> shared memory for dQ (the buffer is free: the wait at the top of the tile).
    unsigned char* dsb = smem + offsetof(Sm, ds);
#pragma unroll
    for (int kq = 0; kq < 4; ++kq) {
      const int c = kq * 16 + 2 * tig;
      *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow, c)) = da[kq][0];
      *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow + 8, c)) = da[kq][1];
      *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow, c + 8)) = da[kq][2];
      *reinterpret_cast<uint32_t*>(dsb + STile::offset(krow + 8, c + 8)) = da[kq][3];
    }
    fence_proxy_async_smem();
    // dV += P^T dO (while the warpgroups meet), then dQ, then dK += dS^T Q: dQ goes to the writer's
    // buffer while dK still runs (FlashAttention-3's order), instead of after it.
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < 4; ++kq)
      WgmmaRS<D, 1, T>::run(dv, pa[kq], wgmma_desc(sDOs + kq * 2048, QTile::kBlockBytes, 1024));
    wgmma_commit();
    // dQ once both warpgroups' dS^T are in shared memory.
    named_barrier_sync(C::kBarDs, C::kConsumers);
    float dq[kDqCols / 2];
#pragma unroll
    for (int i = 0; i < kDqCols / 2; ++i) dq[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint32_t krow_off = kk * 16 * 128;
      const uint64_t a = wgmma_desc(sDS + krow_off, STile::kBlockBytes, 1024);
      const uint64_t b = wgmma_desc(sK + (dq_col0 / 64) * KTile::kBlockBytes + (dq_col0 % 64) * 2 + krow_off,
                                    KTile::kBlockBytes, 1024);
      WgmmaSS<kDqCols, 1, 1, T>::run(dq, a, b);
    }
    wgmma_commit();
#pragma unroll
    for (int kq = 0; kq < 4; ++kq)
      WgmmaRS<D, 1, T>::run(dk, da[kq], wgmma_desc(sQs + kq * 2048, QTile::kBlockBytes, 1024));
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ (groups complete in order): dO_t is free, dQ is ready
    wgmma_fence_operands(dv);
    wgmma_fence_operands(dq);
    if (lane == 0) doring.release(ds);
    // dQ -> the writer's buffer: boxes of 128 bytes (32 fp32 or int32 columns) x 64 rows, 128-byte
    // swizzle (16-byte chunk c of row r at c ^ (r % 8)); warpgroup g writes the boxes of its D / 2
    // columns.  Accumulator element 4n + 2hh + c: row 16 wl + gid + 8 hh, column 8n + 2 tig + c of
    // the warpgroup's D / 2.
    wait_dq_buffer();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = wl * 16 + gid + hh * 8;
      // Fixed point: the row's unit (BwdParams::dq_unit) gives the same integers whatever the order of adds.
      [[maybe_unused]] const float unit = kDet ? unit_t[r] : 1.f;
#pragma unroll
      for (int n = 0; n < kDqCols / 8; ++n) {
        // Elements 4n + 2hh and 4n + 2hh + 1: row r, chunk ((n % 4) << 1 | tig / 2) ^ (r % 8) of box n / 4.
        const uint32_t chunk = static_cast<uint32_t>(((n & 3) << 1) | (tig >> 1)) ^ static_cast<uint32_t>(r & 7);
        const uint32_t addr = sDQ + (dq_col0 / 32 + (n >> 2)) * (BQ * 128) + r * 128 + (chunk << 4) + ((tig & 1) << 3);
        const float lo = dq[4 * n + 2 * hh], hi = dq[4 * n + 2 * hh + 1];
        if constexpr (kDet)
          asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(__float2int_rn(lo * unit)),
                       "r"(__float2int_rn(hi * unit))
                       : "memory");
        else
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(lo), "f"(hi) : "memory");
      }
    }
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

// Launches mode kDet's instance that `dense` and `fwd_mask` name (grid as the other backward kernels').
template <typename T, int D, bool kDet>
cudaError_t launch_bwd_sm90_ws_mode(const BwdParams& p, const BwdTmaMaps& maps, bool dense, bool fwd_mask,
                                    cudaStream_t stream) {
  using C = BwdWs<D, kDet>;
  auto kernel = dense       ? bwd_main_kernel_sm90_ws<T, D, true, false, kDet>
                : fwd_mask ? bwd_main_kernel_sm90_ws<T, D, false, true, kDet>
                           : bwd_main_kernel_sm90_ws<T, D, false, false, kDet>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err != cudaSuccess) return err;
  const int64_t grid = static_cast<int64_t>(p.n_k_tiles) * p.batch * p.heads_kv * p.head_splits;
  if (grid <= 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), C::kThreads, C::kSmem, stream>>>(p, maps);
  return cudaGetLastError();
}

// Launches the instance that `dense`, `fwd_mask` (the call reads BwdParams::fwd_mask) and `dq_fixed`
// (deterministic mode: BwdParams::dq_fixed) name.
template <typename T, int D>
cudaError_t launch_bwd_sm90_ws(const BwdParams& p, const BwdTmaMaps& maps, bool dense, bool fwd_mask, bool dq_fixed,
                               cudaStream_t stream) {
  return dq_fixed ? launch_bwd_sm90_ws_mode<T, D, true>(p, maps, dense, fwd_mask, stream)
                  : launch_bwd_sm90_ws_mode<T, D, false>(p, maps, dense, fwd_mask, stream);
}

}  // namespace cuda
}  // namespace mala

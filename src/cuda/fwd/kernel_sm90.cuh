// The two-warpgroup forward kernel on Hopper tensor cores (wgmma), head dim 128, sm_90a, with K and V
// loaded by cp.async.  The dispatch runs it where the TMA cannot describe K and V (varlen inputs
// without total_k, strides the TMA cannot take); everything else on sm_90 at d = 128 runs the
// 128-key kernel (fwd/kernel_sm90_k128.cuh).  (At d = 64 it is slower than the mma.sync
// kernel, so it is not instantiated there.)
// Same decisions as the mma.sync kernel: the decision tile is 32 query rows x 64 keys (FwdConfig),
// key tiles are visited from the diagonal down, the online test reads the running normaliser, and V
// is loaded lazily -- so the tile mask, the slots and the outputs are those of the mma.sync kernel.
//
// A CTA is two warpgroups (256 threads) over 128 query rows; warpgroup g owns rows 64g..64g+63, its
// warp w rows 16w..16w+15 of those, and the warp pair w/2 one decision tile's 32 rows.  Per key tile:
//   S = Q K^T       m64n64 per warpgroup, A = Q from registers (loaded once), B = K (K-major)
//   mask, row max, test per warp; the pair's decision from the two warps' votes (the flag vote,
//   attn/skip.cuh; no vote at tau = 0)
//   retained pair: online-softmax update, P = exp2(S - m);  skipped pair: P = 0, m, l, O untouched
//   O += P V        m64nD, A = P from registers, B = V (MN-major); only if a pair of the warpgroup
//                   retains (P V is one warpgroup instruction: a skipped pair's zero rows add
//                   nothing to its O, since 0 * v = 0 for finite v)
// Two key tiles per step: P V of tile j, then tiles j - 1 and j - 2 decided in order, with S_{j-2}
// running on the tensor cores while tile j - 1 is tested and exponentiated; the main loop does two
// such steps per iteration, the second with its barrier moved ahead so that S_{j-3} runs while j - 2
// is decided.  K and V (4-tile rings, V lazily) live in 128-byte-swizzled tiles (GmmaTile), issued
// two tiles at a time by cp.async from every thread at a CTA barrier every second iteration (which
// frees the buffers they overwrite and or-reduces the retention of the tile that decides the next V
// prefetch), made visible to the tensor cores' async proxy by fence.proxy.async before the barrier.
// One barrier per two tiles lets the warpgroups drift apart by up to a tile, so one's exponentials
// overlap the other's products.  A V that was not prefetched is loaded by a warpgroup that retains
// the tile into its own buffer, so no vote needs the whole CTA.
#pragma once

#include "cuda/core/smem_tile.cuh"
#include "cuda/core/wgmma.cuh"
#include "cuda/fwd/common.cuh"

namespace mala {
namespace cuda {

template <int D_>
struct FwdSm90 {
  static constexpr int D = D_;
  static_assert(D == 64 || D == 128, "wgmma forward: head dim 64 or 128 (64 compiles, not used)");
  static constexpr FwdTiles kTiles = fwd_tiles(FwdKernelKind::sm90, D);  // fwd/tiles.h
  static constexpr int kThreads = 256, BQ = kTiles.bq, BK = kTiles.bk, kPairRows = kTiles.dec_rows;
  static_assert(BK == 64 && kPairRows == 32, "the decision tile is a warp pair's 32 rows x 64 keys");
  using QTile = SmemTile<BQ, D>;    // row-major, read once into registers with ldmatrix
  using KVTile = GmmaTile<BK, D>;   // K (K-major B of Q K^T), V (MN-major B of P V)
  // One CTA barrier per two key tiles: the loads for tiles j - 2 and j - 3 are issued at the
  // barrier of iteration j (every second iteration), so K and V each keep 4 tiles.
  static constexpr int kKBufs = kTiles.k_stages, kVBufs = kTiles.v_stages;
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKBufs * KVTile::kBytes;
  static constexpr int kOffVOwn = kOffV + kVBufs * KVTile::kBytes;  // [2]: each warpgroup's on-demand V
  static constexpr int kOffQ = kOffVOwn + 2 * KVTile::kBytes;
  static constexpr int kOffVote = kOffQ + QTile::kBytes;        // [2][8] per-warp retention flags
  static constexpr int kBytes = kOffVote + 16 * 4;
  static constexpr int kSmem = kBytes + 1024;  // slack to align the base to 1024 bytes
  // One CTA of two warpgroups per SM (CTAs of one warpgroup, two per SM, have independent barriers
  // but twice the K/V traffic, and ran slower).
  static constexpr int kMinBlocks = 1;
};

// kDense: the instance for tau = 0, without the test, the vote and the lazy V (fewer registers).
template <typename T, int D, bool kDense>
__global__ void __launch_bounds__(FwdSm90<D>::kThreads, FwdSm90<D>::kMinBlocks)
    mala_fwd_kernel_sm90(const FwdParams p) {
#ifdef MALA_WGMMA_ENABLED
  using C = FwdSm90<D>;
  constexpr int BQ = C::BQ, BK = C::BK, NT = BK / 8, DT = D / 8, KS = D / 16, NTH = C::kThreads;
  using QTile = typename C::QTile;
  using KVTile = typename C::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wl = warp & 3, pair = wl >> 1;
  const int b = blockIdx.z, h = blockIdx.y;
  const int qtile = longest_first_query_tile(p.causal);

  const FwdSeq<T> sq = fwd_seq<T>(p, b, h);
  const int Nq = sq.Nq, Nk = sq.Nk;

  const int row_cta = qtile * BQ;
  const int row_wg = row_cta + 64 * wg;
  const int row_pair = row_wg + 32 * pair;
  const int row_w = row_wg + 16 * wl;
  const int n_tiles = sq.key_tiles(row_cta, BQ, BK, p.causal);
  const int wg_hi = sq.last_tile(row_wg, 64, BK, p.causal);     // last tile with a legal key for the warpgroup
  const int pair_hi = sq.last_tile(row_pair, 32, BK, p.causal); // ... for the decision tile
  const int min_L_w = row_w + 16 <= Nq ? rule::visible_keys(row_w, Nq, Nk, p.causal) : 0;

  const bool test_on = !kDense && p.log2_tau > -INFINITY;
  uint32_t* s_vote = reinterpret_cast<uint32_t*>(smem + C::kOffVote);
  // Test inputs of this lane's two rows, in registers (every lane of a quad holds the full row sums).
  // (Never a seeded split: dispatch.cu sends those to the other kernels, which hold the registers the
  // seed's bookkeeping needs; rows_before is applied here too.)
  float log_thr[1][2], log_norm[1][2];
  wgmma_fwd_test_inputs(log_thr, log_norm, b, h, row_w, lane, Nq, Nk, p);
  // The pair's first warp records its decisions.
  uint8_t* mask_row = (wl & 1) == 0 ? wgmma_fwd_mask_row(p, b, h, row_pair, 32, pair_hi, lane) : nullptr;

  float m[1][2], l[1][2], acc[1][DT][4];
  softmax_init<1, DT>(m, l, acc);
  float(&acc_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&acc[0][0][0]);
  int retained = 0;

  const uint32_t sK0 = sbase + C::kOffK, sV0 = sbase + C::kOffV, sQ = sbase + C::kOffQ;
  // Tile t's K and V live in buffer t % 4 of their rings (barrier_top below says when each is loaded).
  auto load_k = [&](int t) {
    const int slot = t & (C::kKBufs - 1);
    KVTile::template load_async<NTH>(sK0 + slot * KVTile::kBytes, sq.k + (int64_t)t * BK * p.k_sr, p.k_sr,
                                     Nk - t * BK, tid);
  };
  auto load_v = [&](int t) {
    const int slot = t & (C::kVBufs - 1);
    KVTile::template load_async<NTH>(sV0 + slot * KVTile::kBytes, sq.v + (int64_t)t * BK * p.v_sr, p.v_sr,
                                     Nk - t * BK, tid);
  };

  uint32_t qreg[KS][4];
  // Scores of two tiles: an iteration handles two tiles, and the second one's S runs on the tensor
  // cores while the first one is tested and turned into P.
  using STile = float[1][NT][4];
  using SFlat = float[BK / 2];
  float sA[1][NT][4], sB[1][NT][4], mx[1][2];
  uint32_t pa[BK / 16][4];  // P of the tile whose P V is next (zeros on a skipped pair's rows)
  // S_t = Q K_t^T into s, issued (K_t must be in shared memory; the caller commits).
  auto issue_s = [&](int t, STile& s) {
    SFlat& s_flat = *reinterpret_cast<SFlat*>(&s[0][0][0]);
#pragma unroll
    for (int e = 0; e < BK / 2; ++e) s_flat[e] = 0.f;
    wgmma_fence();
    const uint64_t dK = wgmma_desc(sK0 + (t & (C::kKBufs - 1)) * KVTile::kBytes, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
      WgmmaRS<BK, 0, T>::run(s_flat, qreg[ks], wgmma_desc_advance(dK, (ks >> 2) * KVTile::kBlockBytes + (ks & 3) * 32));
  };
  // Decision for tile t whose scores are in s (have_s; false: no legal key for the warpgroup):
  // mask, row max, test, the pair's vote over the warpgroup.  Every thread calls it (it has a barrier
  // when test_on).
  bool pair_retain = false, wg_any = false;
  auto decide = [&](int t, bool have_s, STile& s) {
    bool warp_retain = false;
    if (have_s)
      warp_retain = warp_mask_max_test<NT, !kDense>(s, mx, t * BK, min_L_w, row_w, lane, Nq, Nk, p, test_on, log_norm, log_thr);
    if (test_on) {
      pair_vote_flags(s_vote + 8 * (t & 1), warp, lane, wg, pair, warp_retain, pair_retain, wg_any);
    } else {
      pair_retain = t <= pair_hi;
      wg_any = t <= wg_hi;
    }
    if (mask_row && lane == 0 && t <= pair_hi) mask_row[t] = pair_retain ? kTileRetained : kTileSkipped;
  };
  // P of the decided tile: exponentials (retained pair), rescale factors for acc.
  float alpha[1][2];
  auto scores_to_p = [&](STile& s) {
    if (pair_retain) {
      quad_row_max<1>(mx);
      softmax_scores<1, NT>(s, mx, p.scale_log2, m, l, alpha);
      if (test_on) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) log_norm[0][hh] = log2_norm(m[0][hh], l[0][hh]);
      }
    }
  };
  // (Zeros only where the warpgroup's P V runs: a tile no pair of the warpgroup retains leaves pa.)
  auto pack_p = [&](STile& s) {
    if (pair_retain) {
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) p_to_a<T, 1, NT>(s, 0, kk, pa[kk]);
    } else if (wg_any) {
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    }
  };

  // Prologue: Q, K and V of the first two tiles, K of the third; the first tile's scores and decision.
  // (It repeats finish_tile's steps rather than calling it: defining the loop's lambdas first and
  // calling finish_tile here changed the register allocation for the worse.)
  const int top = n_tiles - 1;
  bool cur_retain = false, cur_wg_any = false;  // decisions of the tile whose P V is next
  bool cur_v_own = false;  // the V of the tile whose P V is next is in this warpgroup's own buffer
  if (n_tiles > 0) {
    QTile::template load_async<NTH>(sQ, sq.q + (int64_t)row_cta * p.q_sr, p.q_sr, Nq - row_cta, tid);
    load_k(top);
    load_v(top);
    cp_async_commit();
    if (top >= 1) {
      load_k(top - 1);
      load_v(top - 1);
    }
    if (top >= 2) load_k(top - 2);
    cp_async_commit();
    cp_async_wait<1>();  // Q, K and V of the first tile
    fence_proxy_async_smem();
    __syncthreads();
    const uint32_t q_lane = QTile::lane_off_a(lane);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) ldmatrix_x4(qreg[ks], QTile::frag_addr(sQ, q_lane, 64 * wg + 16 * wl, ks * 16));
    const bool have_s = top <= wg_hi;
    issue_s(top, sA);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(*reinterpret_cast<SFlat*>(&sA[0][0][0]));
    decide(top, have_s, sA);
    scores_to_p(sA);
    if (pair_retain) softmax_rescale<1, DT>(alpha, acc);
    pack_p(sA);
    cur_retain = pair_retain;
    cur_wg_any = wg_any;
  }

  // The barrier of iteration j (every second iteration, from the first): K_{j-1}, K_{j-2}, V_j and
  // V_{j-1} have landed (this thread's copies; after the barrier everyone's), and every warp is done
  // with the buffers of tiles j + 1 .. j + 3, which the loads of K_{j-3}, K_{j-4}, V_{j-2} and V_{j-3}
  // below reuse.  It also or-reduces the retention of tile j: V_{j-2} and V_{j-3} are prefetched
  // when some warp retained it.  Returns whether they were.
  auto barrier_top = [&](int j) {
    cp_async_wait<0>();
    fence_proxy_async_smem();
    bool pref_v = true;
    if (kDense) {
      __syncthreads();
    } else {
      const bool any_j = __syncthreads_or(cur_retain) != 0;
      pref_v = !test_on || any_j;
    }
    if (pref_v) {
      if (j >= 2) load_v(j - 2);
      if (j >= 3) load_v(j - 3);
    }
    if (j >= 3) load_k(j - 3);
    if (j >= 4) load_k(j - 4);
    cp_async_commit();
    return pref_v;
  };
  // V_t when it was not prefetched and this warpgroup retains tile t: loaded by the warpgroup alone
  // into its own buffer (no CTA barrier, so the warpgroups stay apart on sparse inputs too).
  const uint32_t sVOwn = sbase + C::kOffVOwn + wg * KVTile::kBytes;
  auto load_v_own = [&](int t) {
    KVTile::template load_async<128>(sVOwn, sq.v + (int64_t)t * BK * p.v_sr, p.v_sr, Nk - t * BK, tid & 127);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async_smem();
    warpgroup_barrier_sync(wg);
  };
  // O += P V for tile j; completes inside its branch (see below).
  auto pv_tile = [&](int j) {
    if (cur_wg_any) {
      wgmma_fence();
      const uint64_t dV = wgmma_desc(cur_v_own ? sVOwn : sV0 + (j & (C::kVBufs - 1)) * KVTile::kBytes, KVTile::kBlockBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) WgmmaRS<D, 1, T>::run(acc_flat, pa[kk], wgmma_desc_advance(dV, kk * 2048));
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(acc_flat);
    }
  };
  // ptxas serializes every wgmma of the kernel when a wgmma's registers are in flight across the
  // join of a branch it cannot prove uniform (even one on j), so S is issued unconditionally (a
  // warpgroup with no legal key in the tile computes and ignores it) and the data-dependent P V
  // completes inside its branch.
  // Tile t after its S completed (and the previous tile's P V, whose acc it rescales): the decision,
  // V on demand into the warpgroup's own buffer, P.  pref_t: V_t was prefetched.
  auto finish_tile = [&](int t, bool pref_t, STile& s) {
    decide(t, t <= wg_hi, s);
    // (Before the load, the vote's barrier has every warp of the warpgroup past its last P V, which
    // read this buffer.)
    const bool v_own = test_on && !pref_t && wg_any;
    if (v_own) load_v_own(t);
    scores_to_p(s);
    if (pair_retain) softmax_rescale<1, DT>(alpha, acc);
    pack_p(s);
    cur_retain = pair_retain;
    cur_wg_any = wg_any;
    cur_v_own = v_own;
  };
  auto s_done = [&](STile& s) { wgmma_fence_operands(*reinterpret_cast<SFlat*>(&s[0][0][0])); };
  // A two-tile step, one barrier: P V of tile j (P from the previous step), then tiles j - 1 and
  // j - 2 decided in order (the online test of j - 2 sees the normaliser after j - 1), S_{j-2}
  // computed on the tensor cores while tile j - 1 is tested and exponentiated.  No wgmma is in
  // flight across a loop's back edge (ptxas would serialize them all).
  bool pref_cur = true, pref_next = true;  // V prefetched for tiles j, j - 1 / for j - 2, j - 3
  int j = top;
  // The end of a two-tile step: S_{i-1} issued into sB, tile i decided from sA (S_{i-1} on the
  // tensor cores meanwhile), its P V, and S_{i-1} complete (its decision is the caller's).
  auto decide_and_issue_next = [&](int i) {
    issue_s(i - 1, sB);
    wgmma_commit();
    wgmma_wait<1>();
    s_done(sA);
    finish_tile(i, pref_cur, sA);
    if (cur_retain) ++retained;
    pv_tile(i);
    wgmma_wait<0>();
    s_done(sB);
  };
  // The two-tile step from the barrier of j: P V of tile j (decided before), tile j - 1 decided,
  // S_{j-2} complete in sB.
  auto two_tiles = [&](int j) {
    pref_cur = pref_next;
    pref_next = barrier_top(j);
    if (cur_retain) ++retained;
    issue_s(j - 1, sA);
    wgmma_commit();
    pv_tile(j);
    decide_and_issue_next(j - 1);
  };
  // The main loop takes four tiles per iteration: a two-tile step, then a second one whose barrier
  // (of j - 2) comes ahead of tile j - 2's decision so that S_{j-3} runs on the tensor cores while
  // j - 2 is decided; only the last decision of the four waits with nothing in flight.  (The
  // barrier's or-reduction then carries tile j - 1's retention, which only steers the V prefetch.)
  // (Six or eight tiles per iteration in the same way ran slower: code size and schedule.)  The
  // two-tile loop takes what is left.
  for (; j >= 4; j -= 4) {
    two_tiles(j);
    // The second step, its barrier ahead of tile j - 2's decision.
    pref_cur = pref_next;
    pref_next = barrier_top(j - 2);
    issue_s(j - 3, sA);
    wgmma_commit();
    finish_tile(j - 2, pref_cur, sB);
    if (cur_retain) ++retained;
    pv_tile(j - 2);
    decide_and_issue_next(j - 3);
    finish_tile(j - 4, pref_next, sB);
  }
  for (; j >= 2; j -= 2) {
    two_tiles(j);
    finish_tile(j - 2, pref_next, sB);
  }
  if (j == 1) {
    pref_cur = pref_next;
    pref_next = barrier_top(1);
    if (cur_retain) ++retained;
    issue_s(0, sA);
    wgmma_commit();
    pv_tile(1);
    wgmma_wait<0>();
    s_done(sA);
    finish_tile(0, pref_cur, sA);
    if (cur_retain) ++retained;
    pv_tile(0);
  } else if (n_tiles > 0) {
    barrier_top(0);
    if (cur_retain) ++retained;
    pv_tile(0);
  }

  fwd_epilogue<T, 1, DT>(p, sq, b, h, row_w, lane, m, l, acc, retained * BK);
#endif
}

// Launches the instance `dense` names (grid: query tiles of 128 rows, heads, batch).
template <typename T, int D>
cudaError_t launch_fwd_sm90(const FwdParams& p, bool dense, cudaStream_t stream) {
  using C = FwdSm90<D>;
  auto kernel = dense ? mala_fwd_kernel_sm90<T, D, true> : mala_fwd_kernel_sm90<T, D, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err != cudaSuccess) return err;
  dim3 grid(rule::ceil_div(p.seqlen_q, C::BQ), p.heads_q, p.batch);
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

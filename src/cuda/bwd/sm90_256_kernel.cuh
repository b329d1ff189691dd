// The d = 256 backward on Hopper (wgmma + TMA), sm_90a: the kernels for every tau whenever the TMA
// can describe Q, dO, K, V (dispatch.cu).  Two kernels:
//   key-major (bwd_main_kernel_sm90_ws256): dK and dV, and every tile decision, into the tile mask.
//     Same decisions, tile mask, slots and gradients as the mma.sync kernel (decision tile 32 query
//     rows x 64 keys).  One CTA per (key tile of 64 keys, sequence, KV head, head split), query tiles
//     of 64 rows ascending from the first legal one, each the two 32-row decision tiles of one CTA
//     step.  dQ is not computed here: its partials, 64 KB of fp32 adds per 64 x 64 tile into an
//     accumulator, took longer than all the rest of the kernel at the L2's reduction rate.
//   query-major (bwd_dq_kernel_sm90_ws256, bwd/sm90_256_dq_kernel.cuh): dQ, reading the decisions from
//     the tile mask recorded here.
//
// The key-major kernel's three warpgroups (384 threads), by role:
//   shell (this file): shared memory (BwdWs256::Storage, bwd/sm90_256_traits.cuh), the mbarriers'
//     init, the warp roles, the launcher of both kernels;
//   producer (warpgroup 0, 24 registers; bwd/sm90_256_producer.cuh): warp 0 K and V once, then Q_t
//     with its rows' lse and skip bound into a ring of 2 slots; warp 1 dO_t with D = rowsum(dO * O)
//     into a ring of 2 slots (full / empty mbarriers: MbarRing, core/pipeline.cuh);
//   consumers (warpgroups 1 and 2, 240 registers): per tile S^T and dP^T by query rows, the test and
//     the vote, P^T and dS^T into shared memory, dV and dK by head dims; after the last tile dK and
//     dV into the outputs.  The loop, its decisions and the rings' bookkeeping in this file's kernel
//     body; the tile's products, the P^T / dS^T stores and the dK / dV stores in
//     bwd/sm90_256_consumer.cuh.
//
// At d = 256 a warpgroup cannot keep dK and dV of all 64 keys x 256 dims (256 registers a thread),
// so the two consumer warpgroups split the work of a tile two ways:
//   by query rows  S^T_g = K Q_g^T, dP^T_g = V dO_g^T  (m64n32k256: warpgroup g's 32 rows, its
//                  decision tile), the mask, the offline test and P^T_g, dS^T_g in registers, both
//                  stored (bf16) into one 64 x 64 tile each in shared memory;
//   by head dims   dV[:, 128g..] += P^T dO[:, 128g..],  dK[:, 128g..] += dS^T Q[:, 128g..]
//                  (m64n128k64, over the retained row halves only).
// Per tile t:
//   wait S^T(t), dP^T(t);  mask, test: each warp's verdict into a word;  P^T, dS^T
//   wait until both warpgroups have finished reading tile t - 1's P^T / dS^T (mbarrier), store
//   barrier (both halves stored, both verdicts in): a half is retained iff one of its 4 warps blocks
//   issue dV and dK;  then S^T(t + 1), dP^T(t + 1), so that the tensor cores hold the next tile's
//   products while this tile's slots go back.
// A tile whose halves are both skipped issues no dV or dK work.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_256_consumer.cuh"
#include "cuda/bwd/sm90_256_dq_kernel.cuh"
#include "cuda/bwd/sm90_256_producer.cuh"
#include "cuda/bwd/sm90_256_traits.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/tma.cuh"
#include "cuda/core/wgmma.cuh"

namespace mala {
namespace cuda {

template <typename T, bool kDense>
__global__ void __launch_bounds__(384, 1)
    bwd_main_kernel_sm90_ws256(const BwdParams p, const __grid_constant__ BwdTmaMaps maps) {
#ifdef MALA_WGMMA_ENABLED
  using C = BwdWs256;
  constexpr int BQ = C::BQ, BK = C::BK, BH = C::BH, NS = C::kStages;
  using QTile = typename C::QTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* smem = smem_align_1024(smem_raw, sbase);
  const int tid = threadIdx.x;

  const BwdWork w = bwd_cta_work<BQ, BK>(p);
  if (w.kb >= w.klen) return;
  const int qlen = w.qlen, klen = w.klen, kb = w.kb, kn = w.kn, n_iter = w.n_iter;

  using Sm = typename C::Storage;
  Sm& st = *reinterpret_cast<Sm*>(smem);
  const uint32_t sK = sbase + offsetof(Sm, k), sV = sbase + offsetof(Sm, v), sQ = sbase + offsetof(Sm, q),
                 sDO = sbase + offsetof(Sm, dout), sP = sbase + offsetof(Sm, p), sDS = sbase + offsetof(Sm, ds);
  const uint32_t mb_kv = sbase + offsetof(Sm, kv_bar);
  const MbarRing<NS> qring = MbarRing<NS>::at(sbase + offsetof(Sm, q_bar));
  const MbarRing<NS> doring = MbarRing<NS>::at(sbase + offsetof(Sm, do_bar));
  const uint32_t mb_st_free = sbase + offsetof(Sm, st_free_bar);
  if (tid == 0) {
    mbar_init(mb_kv, 2);  // K's and V's expect_tx arrivals
    // Slot by slot, both rings side by side (the order of the inits reaches the PTX): the producer's
    // expect_tx arrival; one arrival per consumer warp.
    for (int i = 0; i < NS; ++i) {
      qring.init_slot(i, 1, 8);
      doring.init_slot(i, 1, 8);
    }
    mbar_init(mb_st_free, 8);  // each consumer warp, once its reads of a tile's P^T and dS^T are done
    fence_mbarrier_init();
  }
  __syncthreads();

  // TMA coordinates of this sequence's row 0: varlen maps the packed rows as one batch entry.
  const int q_row0 = w.varlen ? static_cast<int>(w.qrow0) : 0, k_row0 = w.varlen ? static_cast<int>(w.krow0) : 0;
  const int map_b = w.varlen ? 0 : w.b;

  if (tid < 128) {
    setmaxnreg_dec24();
    const int warp = tid >> 5, lane = tid & 31;
    if (lane == 0 && warp == 0)
      bwd256_load_q<kDense>(p, maps, w, n_iter, kb, qring, mb_kv, sbase, sK, sV, sQ, q_row0, k_row0, map_b);
    else if (lane == 0 && warp == 1)
      bwd256_load_do(p, maps, w, n_iter, doring, sbase, sDO, q_row0, map_b);
    return;
  }

  // The consumers' loop, in the kernel's body: as a function of their own (bwd256_consume) they
  // changed the SASS of the skipping instance, in every form tried (journal.md, issue 63); their
  // steps are bwd/sm90_256_consumer.cuh's.
  setmaxnreg_inc240();
  const int ctid = tid - 128, warp = __shfl_sync(0xffffffffu, ctid >> 5, 0), lane = ctid & 31, wg = warp >> 2,
            wl = warp & 3, gid = lane >> 2, tig = lane & 3;
  const int krow = 16 * wl + gid;  // this thread's first key row of S^T (+8: second)
  const int qcol = BH * wg;        // this warpgroup's first query row of the tile (its decision tile)
  const float* lse_s = &st.lse[0][0];
  const float* bound_s = &st.bound[0][0];
  const float* dsum_s = &st.dsum[0][0];
  uint32_t* vote_s = &st.vote[0][0];
  const bool recording = p.tile_mask != nullptr || p.bwd_slots != nullptr;
  // The first legal 32-row query tile of this key tile (a half before it has no legal entry: it is
  // neither recorded nor counted, as in the mma.sync kernel, which never visits it).
  const int i_first32 = p.causal ? max(kb - (klen - qlen), 0) / BH : 0;

  float dk[64], dv[64];  // m64n128: keys 0..63 x dims 128 wg..
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
  float s[16], dp[16];

  mbar_wait<true>(mb_kv, 0);
  // S^T(t) and dP^T(t) of this warpgroup's 32 rows, one group: X Y_g^T over d (X = K or V, Y = Q_t or dO_t).
  auto issue_s_dp = [&](int t) {
    const int qs = t & 1;
    // The Q wait by hand (slot address, then parity): through consumer_wait it changed the skipping
    // instances' SASS (core/pipeline.cuh's note on the parity computed first).
    mbar_wait<true>(qring.full(qs), bwd_ws_parity(t >> 1));
    doring.consumer_wait(RingPos{qs, bwd_ws_parity(t >> 1)});
#pragma unroll
    for (int e = 0; e < 16; ++e) s[e] = dp[e] = 0.f;
    // The zeros pinned before the first product: left free, ptxas sinks dP^T's behind S^T's wgmmas and
    // then serialises them (C7515).
    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    wgmma_fence();
    const uint32_t yq = sQ + qs * QTile::kBytes + qcol * 128, yd = sDO + qs * QTile::kBytes + qcol * 128;
    bwd256_keys_x_rows<T>(s, dp, sK, sV, yq, yd);
  };
  // dV += P^T dO, dK += dS^T Q over the query steps of the retained halves (k16 steps K0 .. K1 - 1).
  auto issue_dkdv = [&](int qs, auto k0, auto k1) {
    constexpr int K0 = decltype(k0)::value, K1 = decltype(k1)::value;
    const uint32_t bdo = sDO + qs * QTile::kBytes + 2 * wg * QTile::kBlockBytes,
                   bq = sQ + qs * QTile::kBytes + 2 * wg * QTile::kBlockBytes;
    bwd256_dkdv<T, K0, K1>(dv, dk, sP, sDS, bdo, bq);
  };
  auto release_slots = [&](int qs) {
    if (lane == 0) {
      qring.release(qs);
      doring.release(qs);
    }
  };

  BwdWork::Tile x = w.tile(0);
  if (n_iter > 0) issue_s_dp(0);
  for (int t = 0; t < n_iter; ++t, x = w.next(x)) {
    const int qs = t & 1, h = x.h(), q0 = x.qi() * BQ;
    wgmma_wait<0>();  // S^T(t), dP^T(t)
    wgmma_fence_operands(s);
    wgmma_fence_operands(dp);
    // Mask: entry 4n + 2hh + c is key krow + 8hh, query row qcol + 8n + 2tig + c of the tile.
    const int qw = q0 + qcol;
    if (keys_x_rows_needs_mask(qw, BH, kb, BK, qlen, klen, p.causal))
      apply_mask_keys_x_rows<4>(s, kb + krow, qw, lane, qlen, klen, p.causal);
    const int vec0 = C::vec_at(p, w, x) & 3;
    if constexpr (!kDense) {
      // The offline test: does some entry of this warp reach its row's raw-score bound?
      const float* bound_t = bound_s + qs * C::kVecStride + vec0 + qcol;
      warpgroup_vote_publish(vote_s + 8 * qs, warp, lane,
                             __any_sync(0xffffffffu, keys_x_rows_blocks_skip<4>(s, bound_t, lane)));
    }
    // P^T = exp2(S^T - lse), dS^T = P^T (dP^T - D), packed for the stores.
    const float* lse_t = lse_s + qs * C::kVecStride + vec0 + qcol;
    const float* dsum_t = dsum_s + qs * C::kVecStride + vec0 + qcol;
    uint32_t pp[8], dd[8];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 4 * n + 2 * hh;
        const float l0 = lse_t[n * 8 + 2 * tig], l1 = lse_t[n * 8 + 2 * tig + 1];
        const float d0 = dsum_t[n * 8 + 2 * tig], d1 = dsum_t[n * 8 + 2 * tig + 1];
        const float p0 = exp2f(s[i] * p.scale_log2 - l0), p1 = exp2f(s[i + 1] * p.scale_log2 - l1);
        pp[2 * n + hh] = pack2<T>(p0, p1);
        dd[2 * n + hh] = pack2<T>(p0 * (dp[i] - d0), p1 * (dp[i + 1] - d1));
      }
    if (t > 0) mbar_wait<true>(mb_st_free, bwd_ws_parity(t - 1));  // both warpgroups are done with tile t - 1's
    unsigned char* sp_g = st.p;
    unsigned char* sds_g = st.ds;
    bwd256_store_p_ds(sp_g, sds_g, pp, dd, krow, qcol, tig);
    fence_proxy_async_smem();
    named_barrier_sync(C::kBarStored, C::kConsumers);
    bool kept0 = true, kept1 = true;
    if constexpr (!kDense) {
      kept0 = warpgroup_vote_result(vote_s + 8 * qs, 0);
      kept1 = warpgroup_vote_result(vote_s + 8 * qs, 1);
    }
    const bool kept_own = wg ? kept1 : kept0, any = kept0 || kept1;
    if (recording) {
      const int i32 = 2 * x.qi() + wg;
      if (i32 >= i_first32 && i32 * BH < qlen) bwd_record_tile<BH, BK>(p, w, h, i32, kept_own, ctid & 127);
    }
    // The next tile's S^T and dP^T on either path (a run-time merge of the two paths while a wgmma is
    // in flight makes ptxas serialise every wgmma, C7515).
    auto issue_next = [&]() {
      if (t + 1 < n_iter)
        issue_s_dp(t + 1);
      else
        wgmma_commit();  // (an empty group: the wait below counts the same groups on the last tile)
    };
    if (any) {
      wgmma_fence();
      if (kept0 && kept1)
        issue_dkdv(qs, std::integral_constant<int, 0>{}, std::integral_constant<int, 4>{});
      else if (kept0)
        issue_dkdv(qs, std::integral_constant<int, 0>{}, std::integral_constant<int, 2>{});
      else
        issue_dkdv(qs, std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
      wgmma_commit();
      issue_next();
      wgmma_wait<1>();  // dV, dK: Q_t, dO_t, P^T and dS^T are free
      wgmma_fence_operands(dv);
      wgmma_fence_operands(dk);
    } else {
      issue_next();
    }
    release_slots(qs);
    if (lane == 0) mbar_arrive(mb_st_free);  // this warp's reads of tile t's P^T, dS^T are done
  }
  wgmma_wait<0>();
  wgmma_fence_operands(dk);
  wgmma_fence_operands(dv);

  bwd256_store_dkdv<T>(p, w, dk, dv, krow, kn, wg, tig);
#endif
}

// Launches the instance `dense` names: the key-major kernel (dK, dV, the decisions), then the dQ
// kernel (grid: query tiles of 128 rows, query heads, sequences).
template <typename T>
cudaError_t launch_bwd_sm90_ws256(const BwdParams& p, const BwdTmaMaps& maps, bool dense, cudaStream_t stream) {
  auto kernel = dense ? bwd_main_kernel_sm90_ws256<T, true> : bwd_main_kernel_sm90_ws256<T, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, BwdWs256::kSmem);
  if (err != cudaSuccess) return err;
  const int64_t grid = static_cast<int64_t>(p.n_k_tiles) * p.batch * p.heads_kv * p.head_splits;
  if (grid > 0) kernel<<<static_cast<unsigned>(grid), BwdWs256::kThreads, BwdWs256::kSmem, stream>>>(p, maps);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  auto dq_kernel = dense ? bwd_dq_kernel_sm90_ws256<T, true> : bwd_dq_kernel_sm90_ws256<T, false>;
  err = cudaFuncSetAttribute(dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, BwdDq256::kSmem);
  if (err != cudaSuccess) return err;
  const dim3 dq_grid(rule::ceil_div(p.seqlen_q, BwdDq256::BQ), p.heads_q, p.batch);
  if (p.seqlen_q > 0) dq_kernel<<<dq_grid, BwdDq256::kThreads, BwdDq256::kSmem, stream>>>(p, maps);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

// The warp-specialized backward on Hopper (wgmma + TMA), head dims 64 and 128, sm_90a: the kernel for
// every tau whenever the TMA can describe Q, dO, K, V and the dQ accumulator (dispatch.cu; varlen
// calls when they give total_q and total_k).  Same work split, tile order, offline test, vote and
// outputs as the mma.sync kernel (kernel_sm80.cuh) -- one CTA per (key tile of 128 keys,
// sequence, KV head, head split), query tiles of 64 rows ascending from the first legal one, dK/dV in
// registers -- so the tile mask, the slots and the gradients are its (up to the order of dQ's adds).
//
// Three warpgroups (384 threads), by role:
//   shell (this file): shared memory (BwdWs::Storage, bwd/sm90_traits.cuh), the mbarriers' init,
//     the forward's tile mask read into shared memory (kFwdMask), the warp roles, the launcher;
//   producer (warpgroup 0, 24 registers; bwd/sm90_producer.cuh):
//     warp 0  K and V once, then Q_t with its rows' lse, skip bound (and in the deterministic mode
//             the rows' dQ units) into a ring of kQStages slots (one thread issues every TMA load;
//             full/empty mbarriers: MbarRing, core/pipeline.cuh);
//     warp 1  dO_t with D = rowsum(dO * O) into a ring of 2 slots, speculatively or once the
//             consumers have decided tile t;
//     warp 2  the dQ writer (bwd/sm90_epilogue.cuh): adds each retained tile's dQ into the dQ
//             accumulator by TMA reduce-add, off the consumers' path;
//   consumers (warpgroups 1 and 2, 240 registers; bwd/sm90_consumer.cuh): per tile S^T, the test
//     and the vote, P^T and dS^T, dV, dQ (staged for the writer), dK; warpgroup g owns keys
//     64g..64g+63 of the tile;
//   epilogue (bwd/sm90_epilogue.cuh): dQ staged per tile and the writer's adds; dK and dV after the
//     last tile.
//
// The template flags, in this order everywhere (the kernel, its role functions, the launcher):
//   kDense: tau = 0 (no test, no vote, no decision for the dO producer);
//   kFwdMask (tau > 0): the instance for calls with forward_tile_mask (BwdParams::fwd_mask);
//   kDet: for calls with fixed-point dQ (BwdParams::dq_fixed).
// The other instances carry none of their code.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/sm90_consumer.cuh"
#include "cuda/bwd/sm90_epilogue.cuh"
#include "cuda/bwd/sm90_producer.cuh"
#include "cuda/bwd/sm90_traits.cuh"
#include "cuda/core/pipeline.cuh"
#include "cuda/core/tma.cuh"
#include "cuda/core/wgmma.cuh"

namespace mala {
namespace cuda {

template <typename T, int D, bool kDense, bool kFwdMask, bool kDet>
__global__ void __launch_bounds__(384, 1)
    bwd_main_kernel_sm90_ws(const BwdParams p, const __grid_constant__ BwdTmaMaps maps) {
#ifdef MALA_WGMMA_ENABLED
  using C = BwdWs<D, kDet>;
  constexpr int BQ = C::BQ, BK = C::BK, NQS = C::kQStages;
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
  const uint32_t mb_kv = sbase + offsetof(Sm, kv_bar);
  const MbarRing<NQS> qring = MbarRing<NQS>::at(sbase + offsetof(Sm, q_bar));
  const MbarRing<2> doring = MbarRing<2>::at(sbase + offsetof(Sm, do_bar));
  const uint32_t mb_vote = sbase + offsetof(Sm, vote_bar), mb_dq_full = sbase + offsetof(Sm, dq_full_bar),
                 mb_dq_empty = sbase + offsetof(Sm, dq_empty_bar), mb_dec = sbase + offsetof(Sm, dec_bar);
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

  if (tid < 128) {
    setmaxnreg_dec24();
    const int warp = tid >> 5, lane = tid & 31;
    if (warp == 0)
      bwd_sm90_load_q<D, kDense, kFwdMask, kDet>(p, maps, w, lane, n_iter, kb, is_scored, qring, mb_kv, sbase, sK, sV,
                                                 sQ, q_row0, k_row0, map_b);
    else if (warp == 1)
      bwd_sm90_load_do<D, kDense, kFwdMask, kDet>(p, maps, w, lane, n_iter, is_scored, doring, mb_dec, s_dec, sbase,
                                                  sDO, q_row0, map_b);
    else if (warp == 2 && lane == 0)
      bwd_sm90_write_dq<D, kDet>(maps, sDQ, mb_dq_full, mb_dq_empty, s_dq_row);
    return;
  }
  bwd_sm90_consume<T, D, kDense, kFwdMask, kDet>(p, w, tid, smem, sbase, sK, sV, sQ, sDO, sDS, sDQ, mb_kv, qring,
                                                 doring, mb_vote, mb_dq_full, mb_dq_empty, mb_dec, vote_w, s_dec,
                                                 s_dq_row, is_scored, qlen, klen, kb, kn, n_iter);
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

// The mma.sync forward kernel (FlashAttention-2 class, m16n8k16, sm_80 and later): every head dim
// on devices without wgmma, and d = 64 and 256 on sm_90 too (the wgmma kernels serve d = 128 there).
//
// Grid (query tiles, heads_q, batch); a CTA of kWarps warps owns BQ = kWarps*16*kMT consecutive
// query rows, each warp a contiguous aligned block of 16*kMT rows whose P stays in registers as the
// A operand of P V.  Key tiles of kBk rows are visited from the one holding the CTA's largest legal
// key down to tile 0; K and V are double-buffered in swizzled shared memory with cp.async (the next
// tile's K is in flight while the current one is computed).  Per warp and tile:
//   S = Q K^T (every legal tile) -> causal/bounds mask where needed -> row max (needed anyway) ->
//   MALA tile test (tau > 0 only; attn/skip.cuh, the warp vote) ->
//   retained: online-softmax update and O += P V;  skipped: nothing (m, l, acc untouched).
// V is lazy: prefetched with K when tau = 0 or when some warp retained the previous tile (learnt from
// the next tile's __syncthreads_or, a barrier the tile has anyway), otherwise loaded on demand only
// if some warp of the CTA retains the tile (a __syncthreads_or after the test, only on such tiles).
// Sparse inputs thus skip most V loads while retention, which is bursty, keeps random inputs on the
// dense pipeline.  One barrier per tile: the next tile's loads are issued after it, so no
// end-of-tile barrier guards the buffers.
// Decision tile = (16*kMT rows of one warp) x kBk keys; tile_mask/fwd_slots use exactly those.
// The per-row test inputs (log2 threshold, m + log2 l) live in shared memory: at d = 128 the
// 128 fp32 accumulators + 64 scores per thread leave no registers for them.
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "cuda/attn/mask.cuh"
#include "cuda/attn/online_softmax.cuh"
#include "cuda/attn/skip.cuh"
#include "cuda/core/ptx.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/fwd/common.cuh"
#include "cuda/fwd/params.h"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

template <typename T, int D>
struct FwdKernelTraits {
  using Cfg = FwdConfig<D>;
  static constexpr int kMT = Cfg::kMT;
  static constexpr int kWarps = Cfg::kWarps;
  static constexpr int kBk = Cfg::kBk;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = 16 * kMT;
  static constexpr int kBq = kWarps * kRowsPerWarp;
  static constexpr int kNT = kBk / 8;  // n8 tiles of S
  static constexpr int kDT = D / 8;    // n8 tiles of O
  static constexpr int kKS = D / 16;   // k16 steps of Q K^T
  static constexpr bool kQInRegs = kMT * D <= 128;
  // k16 steps of Q K^T unrolled: all of them when Q lives in registers (compile-time indices), else
  // none (Q is re-read from shared memory each step).
  static constexpr int kKsUnroll = kQInRegs ? kKS : 1;
  using QTile = SmemTile<kBq, D>;
  using KVTile = SmemTile<kBk, D>;
  static_assert(Cfg::kTiles.k_stages == 2 && Cfg::kTiles.v_stages == 2, "K and V double-buffered");
  static constexpr int kSmemBytes = QTile::kBytes + 4 * KVTile::kBytes + 2 * kBq * 4;  // Q, 2x(K, V), test state
  // Two CTAs per SM when shared memory allows and 255 registers per thread still fit (128 threads).
  static constexpr int kMinBlocks = (kSmemBytes <= 110 * 1024 && kThreads <= 128) ? 2 : 1;
};

// kDense: the instance for tau = 0, compiled without the test, the vote and the lazy V (their code
// costs registers and time even where it does not run).  kSeeded (tau > 0 only): a seeded split
// (fwd/common.cuh), likewise its own instance.
template <typename T, int D, bool kDense, bool kSeeded>
__global__ void __launch_bounds__(FwdKernelTraits<T, D>::kThreads, FwdKernelTraits<T, D>::kMinBlocks)
    mala_fwd_kernel(const FwdParams p) {
  using Tr = FwdKernelTraits<T, D>;
  constexpr int MT = Tr::kMT, NT = Tr::kNT, DT = Tr::kDT, KS = Tr::kKS, BK = Tr::kBk;
  constexpr int RW = Tr::kRowsPerWarp, BQ = Tr::kBq, NTH = Tr::kThreads;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;

  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = blockIdx.z, h = blockIdx.y;
  // Causal: the last query tiles see the most keys; launch them first.
  const int qtile = longest_first_query_tile(p.causal);

  const FwdSeq<T> sq = fwd_seq<T>(p, b, h);
  const int Nq = sq.Nq, Nk = sq.Nk;
  const T *qp = sq.q, *kp = sq.k, *vp = sq.v;

  const int row_cta = qtile * BQ;
  const int row_w = row_cta + warp * RW;
  const int n_tiles = sq.key_tiles(row_cta, BQ, BK, p.causal);
  const int warp_hi = sq.last_tile(row_w, RW, BK, p.causal);
  // Smallest L over the warp's rows (0 when some row is past the end): tiles reaching it need masking.
  const int min_L_w = row_w + RW <= Nq ? rule::visible_keys(row_w, Nq, Nk, p.causal) : 0;

  const bool test_on = !kDense && p.log2_tau > -INFINITY;
  const FwdAnchors anchors = fwd_held_anchors<BK>(p, row_w, warp_hi, Nq, Nk);  // kSeeded only
  // Test inputs per query row, kept in shared memory (registers are the limit at d = 128):
  // s_thr = log2(tau) - log2(L_q) (fixed), s_norm = m + log2(l) (rewritten by the quad leader after
  // each retained tile, so skipped tiles cost no MUFU).  Each warp touches only its own rows.
  float* s_thr = reinterpret_cast<float*>(smem + QTile::kBytes + 4 * KVTile::kBytes);
  float* s_norm = s_thr + BQ;
  if ((lane & 3) == 0) {
    int lim[MT][2];
    row_limits<MT>(lim, row_w, lane, Nq, Nk, p.causal);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int rr = warp * RW + mt * 16 + (lane >> 2) + hh * 8;
        const int r = row_w + mt * 16 + (lane >> 2) + hh * 8;
        s_thr[rr] = fwd_row_threshold(p, r, lim[mt][hh]);
        s_norm[rr] = fwd_row_seed(p, b, h, r, Nq);  // nothing retained yet (a seeded split: its anchor mass)
      }
  }
  __syncwarp();

  // tile_mask row of this warp's decision tile (null when not requested or past the mask).
  uint8_t* mask_row = nullptr;
  if (p.tile_mask) {
    const int qt = row_w / RW;
    if (qt < p.n_q_tiles_mask) {
      mask_row = p.tile_mask + (((int64_t)b * p.heads_q + h) * p.n_q_tiles_mask + qt) * p.n_k_tiles_mask;
      for (int kt = warp_hi + 1 + lane; kt < p.n_k_tiles_mask; kt += 32) mask_row[kt] = kTileIllegal;
    }
  }

  float m[MT][2], l[MT][2], acc[MT][DT][4];
  softmax_init<MT, DT>(m, l, acc);
  int retained = 0;

  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK0 = sQ + QTile::kBytes;
  const uint32_t sV0 = sK0 + 2 * KVTile::kBytes;
  const uint32_t q_lane = QTile::lane_off_a(lane), k_lane = KVTile::lane_off_b(lane), v_lane = KVTile::lane_off_a(lane);

  if (n_tiles > 0) {
    QTile::template load_async<NTH>(sQ, qp + (int64_t)row_cta * p.q_sr, p.q_sr, Nq - row_cta, tid);
    {
      const int j = n_tiles - 1;
      KVTile::template load_async<NTH>(sK0, kp + (int64_t)j * BK * p.k_sr, p.k_sr, Nk - j * BK, tid);
      KVTile::template load_async<NTH>(sV0, vp + (int64_t)j * BK * p.v_sr, p.v_sr, Nk - j * BK, tid);
    }
    cp_async_commit();
  }

  uint32_t qreg[Tr::kQInRegs ? KS : 1][MT][4];
  // V of tile j is either prefetched with K (v_ready) or loaded on demand after the tile test when
  // some warp retains the tile.  Prefetch policy: always when the test is off (tau = 0: dense
  // pipeline), otherwise when the previous tile was retained by some warp (retention is bursty:
  // random inputs keep the dense pipeline, sparse inputs skip most V loads).  Whether some warp
  // retained a tile comes from the next tile's barrier (__syncthreads_or), so a tile whose V was
  // prefetched needs no barrier between its test and its P V; only an on-demand V load does.
  bool v_ready = true;        // the prologue loads V of the first tile
  bool retained_prev = true;  // this warp retained the previous tile (none before the first: prefetch)
  int buf = 0;
  for (int j = n_tiles - 1; j >= 0; --j) {
    // One barrier per tile: this thread's copies of tile j have landed; after the barrier every
    // thread's have, and every warp is done with tile j + 1, whose buffers (buf ^ 1) the next
    // tile's loads then reuse.  It also or-reduces the warps' retention of tile j + 1.
    cp_async_wait<0>();
    bool last_any = true;
    if constexpr (!kDense) last_any = __syncthreads_or(retained_prev) != 0;
    else __syncthreads();
    const bool pref_v = !test_on || last_any;
    if (j > 0) {
      const int jn = j - 1;
      const uint32_t off = (buf ^ 1) * KVTile::kBytes;
      KVTile::template load_async<NTH>(sK0 + off, kp + (int64_t)jn * BK * p.k_sr, p.k_sr, Nk - jn * BK, tid);
      if (pref_v)
        KVTile::template load_async<NTH>(sV0 + off, vp + (int64_t)jn * BK * p.v_sr, p.v_sr, Nk - jn * BK, tid);
    }
    cp_async_commit();

    if constexpr (Tr::kQInRegs) {
      if (j == n_tiles - 1) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(qreg[ks][mt], QTile::frag_addr(sQ, q_lane, warp * RW + mt * 16, ks * 16));
      }
    }

    const uint32_t sK = sK0 + buf * KVTile::kBytes;
    const uint32_t sV = sV0 + buf * KVTile::kBytes;
    float s[MT][NT][4];
    float mx[MT][2];
    bool retain = false;
    if (j <= warp_hi) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;

      // ---- score discovery: S = Q K^T ----
#pragma unroll Tr::kKsUnroll
      for (int ks = 0; ks < KS; ++ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (Tr::kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mt][e] = qreg[ks][mt][e];
          } else {
            ldmatrix_x4(a[mt], QTile::frag_addr(sQ, q_lane, warp * RW + mt * 16, ks * 16));
          }
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bk[4];
          ldmatrix_x4(bk, KVTile::frag_addr(sK, k_lane, np * 16, ks * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(s[mt][2 * np], a[mt], bk);
            mma_16816<T>(s[mt][2 * np + 1], a[mt], bk + 2);
          }
        }
      }
      if (j * BK + BK > min_L_w) {
        int lim[MT][2];
        row_limits<MT>(lim, row_w, lane, Nq, Nk, p.causal);
        apply_mask<MT, NT>(s, lim, j * BK, lane);
      }

      // Each lane's part of the row max; the reduction over the quad waits for a retained tile.
      // The test is monotone in tile_max, so a row passes iff every lane's part does: the warp's
      // vote over the parts is the vote over the rows, bit for bit.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) lane_row_max<MT, NT>(s, mt, mx[mt][0], mx[mt][1]);
      bool skip = false;
      if (test_on) {
        float tmax[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) tmax[mt][hh] = mx[mt][hh] * p.scale_log2;
        float log_norm[MT][2], log_thr[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int rr = warp * RW + mt * 16 + (lane >> 2) + hh * 8;
            log_norm[mt][hh] = s_norm[rr];
            log_thr[mt][hh] = s_thr[rr];
          }
        skip = warp_vote_skip(lane_rows_allow_skip<MT>(tmax, log_norm, log_thr));
        if constexpr (kSeeded) skip = skip && !fwd_forced_tile(anchors, j);
      }
      retain = !skip;
      if (mask_row && lane == 0) mask_row[j] = skip ? kTileSkipped : kTileRetained;
    }

    // V on demand: only when it was not prefetched and some warp of the CTA retains this tile.
    bool load_v = false;
    if (test_on && !v_ready) {
      load_v = __syncthreads_or(retain) != 0;
      if (load_v) {
        KVTile::template load_async<NTH>(sV, vp + (int64_t)j * BK * p.v_sr, p.v_sr, Nk - j * BK, tid);
        cp_async_commit();
      }
    }

    if (retain) {
      quad_row_max<MT>(mx);
      softmax_step_or_keep<MT, NT, DT, !kDense>(s, mx, p.scale_log2, true, m, l, acc);
    }
    if (load_v) {
      cp_async_wait<0>();  // (also waits for tile j - 1's loads, issued before this one)
      __syncthreads();
    }
    if (retain) {
      // The quad leader rewrites s_norm after all four lanes read it for the test (the vote does
      // not order memory, __syncwarp does); the next tile reads it after its barrier.
      __syncwarp();
      if (test_on && (lane & 3) == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = row_w + mt * 16 + (lane >> 2) + hh * 8;
            s_norm[r - row_cta] = kSeeded ? fwd_log2_norm(p, b, h, r, Nq, m[mt][hh], l[mt][hh])
                                          : log2_norm(m[mt][hh], l[mt][hh]);
          }
      }
      // ---- O += P V ----
      uint32_t pa[BK / 16][MT][4];  // P packed to 16-bit at once: half the registers of fp32 S
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) p_to_a<T, MT, NT>(s, mt, kk, pa[kk][mt]);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, KVTile::frag_addr(sV, v_lane, kk * 16, dp * 16));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(acc[mt][2 * dp], pa[kk][mt], bv);
            mma_16816<T>(acc[mt][2 * dp + 1], pa[kk][mt], bv + 2);
          }
        }
      }
      ++retained;
    }
    retained_prev = retain;
    buf ^= 1;
    v_ready = pref_v;
  }

  if constexpr (kDense) softmax_quad_row_sums<MT>(l);
  fwd_epilogue<T, MT, DT>(p, sq, b, h, row_w, lane, m, l, acc, retained * BK);
}

// Launches the instance `dense` (only where FwdConfig<D> has a dense instance) or `seeded` names.
template <typename T, int D>
cudaError_t launch_fwd_sm80(const FwdParams& p, bool dense, bool seeded, cudaStream_t stream) {
  using Tr = FwdKernelTraits<T, D>;
  auto kernel = seeded ? mala_fwd_kernel<T, D, false, true> : mala_fwd_kernel<T, D, false, false>;
  if constexpr (FwdConfig<D>::kDenseInstance) {
    if (dense) kernel = mala_fwd_kernel<T, D, true, false>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid(rule::ceil_div(p.seqlen_q, Tr::kBq), p.heads_q, p.batch);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala

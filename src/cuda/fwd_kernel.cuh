// The fused MALA forward kernel (FlashAttention-2 class, mma.sync m16n8k16, sm80+).
//
// Grid (query tiles, heads_q, batch); a CTA of kWarps warps owns BQ = kWarps*16*kMT consecutive
// query rows, each warp a contiguous aligned block of 16*kMT rows whose P stays in registers as the
// A operand of P V.  Key tiles of kBk rows are visited from the one holding the CTA's largest legal
// key down to tile 0; K and V are double-buffered in swizzled shared memory with cp.async (the next
// tile's K is in flight while the current one is computed).  Per warp and tile:
//   S = Q K^T (every legal tile) -> causal/bounds mask where needed -> row max (needed anyway) ->
//   MALA tile test (tau > 0 only; rule::row_allows_skip via tile_test.cuh, voted over the warp) ->
//   retained: online-softmax update and O += P V;  skipped: nothing (m, l, acc untouched).
// V (kLazyV, the default): prefetched with K when tau = 0 or when some warp retained the previous
// tile (learnt from the next tile's __syncthreads_or), otherwise loaded on demand only if some warp
// of the CTA retains the tile (a __syncthreads_or after the test, only on such tiles).  Measured on
// H100 at 128K (synthetic, 0.26% retained; tuning build, one call): 1.96x over tau = 0 against 1.84x
// for always-prefetched V.  Taking the retention vote at a barrier the tile has anyway instead of
// after every test moved random inputs from 0.94-0.95x to 0.96-0.97x of tau = 0 (8K-128K, one call)
// and cost about 2% on that sparse case.  One barrier per tile (the next tile's loads are issued
// after it, so no end-of-tile barrier guards the buffers): sparse inputs 1-1.5% faster, dense and
// random unchanged (two interleaved calls).
// Decision tile = (16*kMT rows of one warp) x kBk keys; tile_mask/fwd_slots use exactly those.
// The per-row test inputs (log2 threshold, m + log2 l) live in shared memory: at d = 128 the
// 128 fp32 accumulators + 64 scores per thread leave no registers for them (no spills now).
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "mala/mala.h"
#include "cuda/fwd_params.h"
#include "cuda/mask.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/ptx.cuh"
#include "cuda/smem_tile.cuh"
#include "cuda/tile_test.cuh"

#ifndef MALA_FWD_KS_UNROLL
#define MALA_FWD_KS_UNROLL 1
#endif

namespace mala {
namespace cuda {

// Cfg::kLazyV (optional, default true): load V on demand for tiles some warp retains.
template <typename Cfg, typename = void> struct FwdLazyV { static constexpr bool value = true; };
template <typename Cfg> struct FwdLazyV<Cfg, decltype(void(Cfg::kLazyV))> { static constexpr bool value = Cfg::kLazyV; };

// The sequence one CTA works on: lengths (varlen or padded) and the row-0 pointers of its head.
template <typename T>
struct FwdSeq {
  int Nq, Nk, q_off, k_off;  // k_off: the sequence's first row in the packed k and v (varlen)
  const T *q, *k, *v;
  T* o;
};
template <typename T>
__device__ __forceinline__ FwdSeq<T> fwd_seq(const FwdParams& p, int b, int h) {
  FwdSeq<T> sq;
  sq.Nq = p.seqlen_q;
  sq.Nk = p.seqlen_k;
  sq.q_off = 0;
  sq.k_off = 0;
  int64_t q_base, k_base, v_base, o_base;
  const int hk = h / p.group;
  if (p.cu_q) {
    sq.q_off = p.cu_q[b];
    sq.Nq = p.cu_q[b + 1] - sq.q_off;
    q_base = sq.q_off * p.q_sr;
    o_base = sq.q_off * p.o_sr;
  } else {
    q_base = b * p.q_sb;
    o_base = b * p.o_sb;
  }
  if (p.cu_k) {
    sq.k_off = p.cu_k[b];
    sq.Nk = p.cu_k[b + 1] - sq.k_off;
    k_base = sq.k_off * p.k_sr;
    v_base = sq.k_off * p.v_sr;
  } else {
    k_base = b * p.k_sb;
    v_base = b * p.v_sb;
  }
  sq.q = static_cast<const T*>(p.q) + q_base + h * p.q_sh;
  sq.k = static_cast<const T*>(p.k) + k_base + hk * p.k_sh;
  sq.v = static_cast<const T*>(p.v) + v_base + hk * p.v_sh;
  sq.o = static_cast<T*>(p.o) + o_base + h * p.o_sh;
  return sq;
}

// Epilogue of a warp's block of 16*MT rows starting at row_w: O = acc / l, lse = m + log l (natural
// log), slots = the keys of the retained decision tiles (0 for rows with L = 0, as the CPU counts).
template <typename T, int MT, int DT>
__device__ __forceinline__ void fwd_epilogue(const FwdParams& p, const FwdSeq<T>& sq, int b, int h, int row_w,
                                             int lane, const float (&m)[MT][2], const float (&l)[MT][2],
                                             float (&acc)[MT][DT][4], int slots) {
  float lse[MT][2];
  softmax_finalize<MT, DT>(m, l, acc, lse);
  const int g = lane >> 2, t = lane & 3;
  int lim[MT][2];
  row_limits<MT>(lim, row_w, lane, sq.Nq, sq.Nk, p.causal);
  int64_t lse_base = 0;
  if (p.lse || p.slots) {
    lse_base = p.cu_q ? (int64_t)h * p.cu_q[p.batch] + sq.q_off : ((int64_t)b * p.heads_q + h) * p.seqlen_q;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = row_w + mt * 16 + g + hh * 8;
      if (r >= sq.Nq) continue;
      T* orow = sq.o + (int64_t)r * p.o_sr;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
        *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = pack2<T>(acc[mt][dt][2 * hh], acc[mt][dt][2 * hh + 1]);
      if (t == 0) {
        if (p.lse) p.lse[lse_base + r] = lse[mt][hh];
        if (p.slots) p.slots[lse_base + r] = lim[mt][hh] > 0 ? slots : 0;
      }
    }
}

// The wgmma forwards' per-lane test inputs for the warp's 16 rows from row_w: the log2 threshold of
// each of the lane's two rows, and the running normaliser (nothing retained yet).
__device__ __forceinline__ void wgmma_fwd_test_inputs(float (&log_thr)[1][2], float (&log_norm)[1][2], int row_w,
                                                      int lane, int Nq, int Nk, const FwdParams& p) {
  int lim[1][2];
  row_limits<1>(lim, row_w, lane, Nq, Nk, p.causal);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    log_thr[0][hh] = rule::log_threshold(p.log2_tau, __log2f((float)lim[0][hh]));
    log_norm[0][hh] = -INFINITY;
  }
}
// The tile-mask row of the decision tile (a warp pair's 32 rows from row_pair) when the caller
// records decisions, with its tiles past pair_hi marked illegal (the warp's 32 lanes write them);
// nullptr otherwise.
__device__ __forceinline__ uint8_t* wgmma_fwd_mask_row(const FwdParams& p, int b, int h, int row_pair, int pair_hi,
                                                       int lane) {
  const int qt = row_pair / 32;
  if (p.tile_mask == nullptr || qt >= p.n_q_tiles_mask) return nullptr;
  uint8_t* mask_row = p.tile_mask + (((int64_t)b * p.heads_q + h) * p.n_q_tiles_mask + qt) * p.n_k_tiles_mask;
  for (int kt = pair_hi + 1 + lane; kt < p.n_k_tiles_mask; kt += 32) mask_row[kt] = kTileIllegal;
  return mask_row;
}

// A warp's part of the decision on its 16 rows of a key tile starting at key k0, whose scores are
// in s (the wgmma kernels, one m16 block per warp): the causal/bounds mask where the tile reaches
// past the warp's shortest row (min_L_w keys), each lane's part of the row max into mx, and, when
// test_on, whether the warp retains the tile (true otherwise).  The reduction over the quad waits
// for a retained tile: the test is monotone in tile_max, so a row passes iff every lane's part
// does, and the warp's vote over the parts is the vote over the rows, bit for bit.
// The first half, shared with the warp-specialized kernel (which tests against a raw bound): the
// mask where needed and each lane's part of the row max.
template <int NT>
__device__ __forceinline__ void warp_mask_max(float (&s)[1][NT][4], float (&mx)[1][2], int k0, int min_L_w,
                                              int row_w, int lane, int Nq, int Nk, bool causal) {
  if (k0 + 8 * NT > min_L_w) {
    int lim[1][2];
    row_limits<1>(lim, row_w, lane, Nq, Nk, causal);
    apply_mask<1, NT>(s, lim, k0, lane);
  }
  lane_row_max<1, NT>(s, 0, mx[0][0], mx[0][1]);
}
template <int NT>
__device__ __forceinline__ bool warp_mask_max_test(float (&s)[1][NT][4], float (&mx)[1][2], int k0, int min_L_w,
                                                   int row_w, int lane, int Nq, int Nk, const FwdParams& p,
                                                   bool test_on, const float (&log_norm)[1][2],
                                                   const float (&log_thr)[1][2]) {
  warp_mask_max<NT>(s, mx, k0, min_L_w, row_w, lane, Nq, Nk, p.causal);
  if (!test_on) return true;
  float tmax[1][2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) tmax[0][hh] = mx[0][hh] * p.scale_log2;
  return !warp_vote_skip(lane_rows_allow_skip<1>(tmax, log_norm, log_thr));
}

template <typename T, int D, typename Cfg = FwdConfig<D>>
struct FwdKernelTraits {
  static constexpr int kMT = Cfg::kMT;
  static constexpr int kWarps = Cfg::kWarps;
  static constexpr int kBk = Cfg::kBk;
  static constexpr bool kLazyV = FwdLazyV<Cfg>::value;  // V loaded only for retained tiles (see loop)
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = 16 * kMT;
  static constexpr int kBq = kWarps * kRowsPerWarp;
  static constexpr int kNT = kBk / 8;  // n8 tiles of S
  static constexpr int kDT = D / 8;    // n8 tiles of O
  static constexpr int kKS = D / 16;   // k16 steps of Q K^T
  static constexpr bool kQInRegs = kMT * D <= 128;
  // k16 steps of Q K^T unrolled: all of them when Q lives in registers (compile-time indices).
  static constexpr int kKsUnroll = kQInRegs ? kKS : MALA_FWD_KS_UNROLL;
  using QTile = SmemTile<kBq, D>;
  using KVTile = SmemTile<kBk, D>;
  static constexpr int kSmemBytes = QTile::kBytes + 4 * KVTile::kBytes + 2 * kBq * 4;  // Q, 2x(K, V), test state
  // Two CTAs per SM when shared memory allows and 255 registers per thread still fit (128 threads).
  static constexpr int kMinBlocks = (kSmemBytes <= 110 * 1024 && kThreads <= 128) ? 2 : 1;
};

// kDense: the instance for tau = 0, compiled without the test, the vote and the lazy V (its code
// costs registers and time even where it does not run; see launch_fwd_cfg).
template <typename T, int D, typename Cfg, bool kDense>
__global__ void __launch_bounds__(FwdKernelTraits<T, D, Cfg>::kThreads, FwdKernelTraits<T, D, Cfg>::kMinBlocks)
    mala_fwd_kernel(const FwdParams p) {
  using Tr = FwdKernelTraits<T, D, Cfg>;
  constexpr int MT = Tr::kMT, NT = Tr::kNT, DT = Tr::kDT, KS = Tr::kKS, BK = Tr::kBk;
  constexpr int RW = Tr::kRowsPerWarp, BQ = Tr::kBq, NTH = Tr::kThreads;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;

  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = blockIdx.z, h = blockIdx.y;
  // Causal: the last query tiles see the most keys; launch them first.
  const int qtile = p.causal ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x;

  const FwdSeq<T> sq = fwd_seq<T>(p, b, h);
  const int Nq = sq.Nq, Nk = sq.Nk;
  const T *qp = sq.q, *kp = sq.k, *vp = sq.v;

  const int row_cta = qtile * BQ;
  const int row_w = row_cta + warp * RW;
  // L is non-decreasing in the row, so a block's largest L is its last valid row's.
  auto max_L = [&](int r0, int rows) {
    int last = min(r0 + rows, Nq) - 1;
    return last >= r0 ? rule::visible_keys(last, Nq, Nk, p.causal) : 0;
  };
  const int n_tiles = rule::ceil_div(max_L(row_cta, BQ), BK);
  const int warp_hi = rule::ceil_div(max_L(row_w, RW), BK) - 1;
  // Smallest L over the warp's rows (0 when some row is past the end): tiles reaching it need masking.
  const int min_L_w = row_w + RW <= Nq ? rule::visible_keys(row_w, Nq, Nk, p.causal) : 0;

  const bool test_on = !kDense && p.log2_tau > -INFINITY;
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
        s_thr[rr] = rule::log_threshold(p.log2_tau, __log2f((float)lim[mt][hh]));
        s_norm[rr] = -INFINITY;  // nothing retained yet
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
    if constexpr (Tr::kLazyV && !kDense) last_any = __syncthreads_or(retained_prev) != 0;
    else __syncthreads();
    const bool pref_v = !Tr::kLazyV || !test_on || last_any;
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
      }
      retain = !skip;
      if (mask_row && lane == 0) mask_row[j] = skip ? kTileSkipped : kTileRetained;
    }

    // V on demand: only when it was not prefetched and some warp of the CTA retains this tile.
    bool load_v = false;
    if constexpr (Tr::kLazyV) {
      if (test_on && !v_ready) {
        load_v = __syncthreads_or(retain) != 0;
        if (load_v) {
          KVTile::template load_async<NTH>(sV, vp + (int64_t)j * BK * p.v_sr, p.v_sr, Nk - j * BK, tid);
          cp_async_commit();
        }
      }
    }

    if (retain) {
      quad_row_max<MT>(mx);
      softmax_update<MT, NT, DT>(s, mx, p.scale_log2, m, l, acc);
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
          for (int hh = 0; hh < 2; ++hh)
            s_norm[warp * RW + mt * 16 + (lane >> 2) + hh * 8] = m[mt][hh] + __log2f(l[mt][hh]);
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

  fwd_epilogue<T, MT, DT>(p, sq, b, h, row_w, lane, m, l, acc, retained * BK);
}

// Host-side launch of one instantiation (defined in the instantiation files).
// Cfg: FwdConfig<D> in the library; benchmarks may try other configurations (kMT, kWarps, kBk).
template <typename T, int D, typename Cfg = FwdConfig<D>>
cudaError_t launch_fwd_cfg(const FwdParams& p, cudaStream_t stream) {
  using Tr = FwdKernelTraits<T, D, Cfg>;
  // tau = 0 runs the kDense instance: H100, 32K dense, d = 64 3.46 against 3.81 ms, d = 256 16.9
  // against 18.6.  Not at d = 128, where it measured slower (6.54 against 6.35 ms; the wgmma kernel
  // serves d = 128 on sm_90).
  auto kernel = mala_fwd_kernel<T, D, Cfg, false>;
  if constexpr (D != 128) {
    if (fwd_tau_zero(p)) kernel = mala_fwd_kernel<T, D, Cfg, true>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid(rule::ceil_div(p.seqlen_q, Tr::kBq), p.heads_q, p.batch);
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Resident CTAs per SM of one configuration (tuning/diagnostics).
template <typename T, int D, typename Cfg = FwdConfig<D>>
int fwd_blocks_per_sm() {
  using Tr = FwdKernelTraits<T, D, Cfg>;
  auto kernel = mala_fwd_kernel<T, D, Cfg, false>;
  int n = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes) != cudaSuccess)
    return -1;
  return n;
}

// On sm_90 devices at d = 128 the wgmma kernel (fwd_kernel_sm90.cuh, included by that instantiation
// file) runs at every tau; MALA_FWD_WGMMA=0 selects this kernel there too (tests, benchmarks).  Both
// make the same decisions (tiles of FwdConfig), so the choice changes no result beyond rounding.
// (H100, 32K, both with their dense instances and the final code of the fourteenth stop: the wgmma
// kernel dense 4.90 against 6.33 ms, random tau = 1 5.70 against 6.51, s = 16 2.97 against 3.37;
// docs/kernels.md.)
template <typename T, int D>
bool fwd_sm90_usable();
template <typename T, int D>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream);
template <typename T, int D>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  if constexpr (D == 128) {
    if (fwd_sm90_usable<T, D>()) return launch_fwd_sm90<T, D>(p, stream);
  }
  return launch_fwd_cfg<T, D, FwdConfig<D>>(p, stream);
}

}  // namespace cuda
}  // namespace mala

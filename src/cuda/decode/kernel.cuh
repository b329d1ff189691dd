// The split-KV decode's split kernel (the combine and the append are in combine.cuh and append.cuh).
//
// Split kernel: one CTA of W warps (decode_warps: 8 at d = 128, else 4) per (query tile of 16 packed
// rows, split, query-tile owner, batch).
// It walks the split's legal key tiles newest first (rule::split_tiles of ceil(Nk/BK) tiles) with its
// own m, l and tests every tile with rule::row_allows_skip against the FULL L_q (log2 domain).
// Seeded split rule (p.seeded, docs/spec.md, "Split rules"): the walk is preceded by the anchor
// tiles the split does not own (key tile 0 and the rows' newest legal tiles, rule::is_anchor_tile),
// scored together in one pass before the walk: their K comes through the same slot ring (the
// first prologue loads) and QK, and their exact per-row mass over legal keys is kept as a second
// online pair (ma, la), no P, no V.  The test's denominator is then log_add_exp(ma + log2(la),
// m + log2(l)) (seeded_log2_norm), refreshed whenever l changes; owned anchor tiles are retained
// without a test.
//   QK^T : warp w computes the scores of keys [w*BK/W, (w+1)*BK/W) for all 16 rows (mma m16n8k16);
//          row maxima are exchanged through shared memory (one barrier) so every warp holds the
//          whole tile's row max and takes the same decision (warp_tile_skip_online).
//   PV   : P (bf16/fp16, 16 x BK) goes through shared memory; warp w accumulates output dims
//          [w*D/W, (w+1)*D/W), so m and the accumulator never need a cross-warp reduction (l adds
//          the warps' row sums of P through shared memory).
// Memory (decode is memory-bound, and a split is often only a few tiles long): the sparse variant
// keeps one ring of tile slots.  K streams AHEAD tiles ahead of the test; V is loaded ONLY for
// retained tiles, after the test, into the slot the tile's K has just left, and consumed DEFER tiles
// later: the tile's P and m wait in shared-memory rings while the next tiles' K is scored, so the V
// latency is hidden (the online state m, l is updated at test time; acc catches up at the PV, scaled
// from the m of the previous PV to the m of the tile).  Sharing the slot is what lets K run deep
// when tiles are skipped (separate V slots would sit empty) and keeps V in flight when they are not.
// With tau = 0 nothing can be skipped, so the dense variant streams (K, V) pairs ahead together.
// Why not the forward's shared pieces (attn/online_softmax.cuh, core/smem_tile.cuh): those assume each warp
// owns its own 16-row block and full key tiles; decode has one 16-row block per CTA and splits the
// key dimension (QK) and the head dimension (PV) across warps instead.  The test itself is
// attn/skip.cuh's warp_tile_skip_online over rule::row_allows_skip.
#pragma once

#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/rule.h"
#include "cuda/decode/params.h"
#include "cuda/core/ptx.cuh"
#include "cuda/attn/skip.cuh"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

// cp.async.wait_group with a run-time count n (clamped to 15: leaving fewer groups in flight than
// allowed is still correct).
template <int N = 15>
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  if constexpr (N == 0) {
    cp_async_wait<0>();
  } else {
    if (n >= N) cp_async_wait<N>();
    else cp_async_wait_dyn<N - 1>(n);
  }
}

// Element offset of (row, 16-byte chunk) in a swizzled [rows][NCH*8] 16-bit tile: the chunk index is
// XORed with row % 8 so ldmatrix's 8 row addresses hit distinct banks.
template <int NCH>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * (NCH * 8) + ((chunk ^ (row & 7)) << 3);
}

// One key tile (rows j*BK ..) of K or V into a swizzled shared buffer at sdst; rows past Nk are
// zero-filled.  Thread tid (of THREADS) copies the 16-byte chunk tid % (D/8) of rows tid / (D/8) +
// i*RPI.  The kernel is issue-bound when it skips tiles, so the common case (contiguous, or a tile
// inside one page) costs one 64-bit address per tile and one add and one LDGSTS per chunk, with no
// per-row predicate unless the tile reaches past Nk; pages smaller than a tile take the general
// path (decode_load_tile_paged, not inlined: it is rare and long).
template <typename T, int D, int BK, int THREADS>
__device__ __noinline__ void decode_load_tile_paged(uint32_t sdst, const T* base, int64_t sb, int64_t sr, int64_t sh,
                                                    int j, int b, int kvh, int Nk, const int32_t* block_table,
                                                    int64_t bt_stride, int page_size, int page_shift) {
  constexpr int DCH = D / 8;
  constexpr int RPI = THREADS / DCH;  // rows per load iteration
  constexpr int LOAD_ITERS = BK / RPI;
  const int tid = threadIdx.x, r0 = tid / DCH, ch0 = tid % DCH;
  const int key0 = j * BK + r0;
  const T* hbase = base + kvh * sh + ch0 * 8;
#pragma unroll 4
  for (int i = 0; i < LOAD_ITERS; ++i) {
    const int row = i * RPI + r0, key = key0 + i * RPI;
    const bool valid = key < Nk;
    const T* src = base;
    if (valid) {
      const int pi = page_shift >= 0 ? key >> page_shift : key / page_size;
      const int pr = page_shift >= 0 ? key & (page_size - 1) : key - pi * page_size;
      const int page = block_table[b * bt_stride + pi];
      src = hbase + static_cast<int64_t>(page) * sb + static_cast<int64_t>(pr) * sr;
    }
    cp_async_16(sdst + swz<DCH>(row, ch0) * 2, src, valid);
  }
}

template <typename T, int D, int BK, int THREADS>
__device__ __forceinline__ void decode_load_tile(uint32_t sdst, const T* base, int64_t sb, int64_t sr, int64_t sh, int j,
                                                 int b, int kvh, int Nk, const int32_t* block_table, int64_t bt_stride,
                                                 int page_size, int page_shift, int page_in_tile) {
  constexpr int DCH = D / 8;
  constexpr int RPI = THREADS / DCH;  // rows per load iteration
  constexpr int LOAD_ITERS = BK / RPI;
  if (block_table != nullptr && !page_in_tile) {
    decode_load_tile_paged<T, D, BK, THREADS>(sdst, base, sb, sr, sh, j, b, kvh, Nk, block_table, bt_stride,
                                              page_size, page_shift);
    return;
  }
  const int tid = threadIdx.x, r0 = tid / DCH, ch0 = tid % DCH;
  const int key0 = j * BK + r0;
  // Contiguous, or the whole tile inside one page (page_size a multiple of BK).
  const int64_t tile_base = block_table == nullptr
                                ? static_cast<int64_t>(b) * sb + static_cast<int64_t>(key0) * sr
                                : static_cast<int64_t>(block_table[b * bt_stride + (j * BK) / page_size]) * sb +
                                      static_cast<int64_t>((j * BK) % page_size + r0) * sr;
  const T* src = base + kvh * sh + ch0 * 8 + tile_base;
  const int64_t step = RPI * sr;
  if (key0 + (LOAD_ITERS - 1) * RPI < Nk) {
#pragma unroll
    for (int i = 0; i < LOAD_ITERS; ++i, src += step) cp_async_16(sdst + swz<DCH>(i * RPI + r0, ch0) * 2, src);
  } else {
#pragma unroll
    for (int i = 0; i < LOAD_ITERS; ++i, src += step) {
      const bool valid = key0 + i * RPI < Nk;
      cp_async_16(sdst + swz<DCH>(i * RPI + r0, ch0) * 2, valid ? src : base, valid);
    }
  }
}

template <typename T, int D, bool kDense, bool kLargeSmem>
__global__ void __launch_bounds__(DecodeConfig<D, kLargeSmem>::THREADS, 1) decode_split_kernel(const DecodeParams p) {
  using Cfg = DecodeConfig<D, kLargeSmem>;
  constexpr int BK = Cfg::BK;
  constexpr int W = Cfg::WARPS, THREADS = Cfg::THREADS;
  constexpr int NBUF = kDense ? Cfg::NBUF_DENSE : Cfg::NBUF_SPARSE;
  constexpr int NP = kDense ? 1 : Cfg::NP;       // P (and, sparse, m) slots
  constexpr int DEFER = Cfg::DEFER;               // sparse: PV of a retained tile DEFER tiles later
  constexpr int NST = kDense ? NBUF / 2 : NBUF;   // K stages (sparse: slots, V in its K's slot)
  constexpr int AHEAD = kDense ? NST - 1 : Cfg::AHEAD_SPARSE;  // tiles whose K is issued ahead
  constexpr int TILE = BK * D;                        // elements per tile buffer
  constexpr int DCH = D / 8;                          // 16-byte chunks per K/V/Q row
  constexpr int BKCH = BK / 8;                        // 16-byte chunks per P row
  constexpr int KW = BK / W;                          // keys per warp (QK)
  constexpr int NF = KW / 8;                          // n8 fragments per warp (QK)
  constexpr int DW = D / W;                           // output dims per warp (PV)
  constexpr int NDF = DW / 8;                         // n8 fragments per warp (PV)
  constexpr int KS_QK = D / 16;
  constexpr int KS_PV = BK / 16;
  static_assert(NF % 2 == 0 && NDF % 2 == 0 && (BK * DCH) % THREADS == 0, "tile shape");
  static_assert(NST >= 2 && AHEAD >= 1, "at least two K stages");
  // Sparse: the K of tile i + NST is issued in iteration i + NST - AHEAD, after the barrier that
  // follows the PV of tile i (iteration i + DEFER), so the slot is free; P slots likewise.
  static_assert(kDense || (AHEAD <= NST - DEFER && AHEAD >= DEFER && DEFER + 1 <= NP && AHEAD <= 8), "ring sizes");
  // The 16 rows of a query tile see at most 16 consecutive L_q: their newest tiles are at most two.
  static_assert(BK >= kDecodeBlockQ, "a query tile's newest legal tiles span at most two key tiles");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* bufs = reinterpret_cast<T*>(smem_raw);
  T* sQ = bufs + NBUF * TILE;
  T* sP = sQ + kDecodeBlockQ * D;                                            // [NP][16][BK]
  // Cross-warp exchanges, [16 rows][W warps] so that a row's W values are read as float4s.
  float* red_max = reinterpret_cast<float*>(sP + NP * kDecodeBlockQ * BK);  // [16 rows][W warps]
  float* red_sum = red_max + W * kDecodeBlockQ;                             // [1 or 2][16 rows][W warps]
  float* m_slot = red_sum + (kDense ? 1 : 2) * W * kDecodeBlockQ;           // sparse: [NP][16 rows]

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: the combine kernel may be scheduled now; it waits on
  // griddepcontrol.wait for this grid's completion (and memory) before reading the partials.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // This kernel is itself launched as a dependent of whatever precedes it on the stream (the
  // previous decode call's combine, the append kernel, the caller's kernels), so that its launch
  // overlaps their tail: nothing is read before they are complete.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
  const int qt = blockIdx.x % p.NQT, split = blockIdx.x / p.NQT, hs = blockIdx.y, b = blockIdx.z;
  const int kvh = p.pack ? hs : hs / p.G;
  const T* gq = static_cast<const T*>(p.q);
  // Q tile -> shared (zero rows past R), issued before the cache length is read: it does not depend on it.
  for (int c = tid; c < kDecodeBlockQ * DCH; c += THREADS) {
    const int lr = c / DCH, ch = c % DCH, r = qt * kDecodeBlockQ + lr;
    const bool valid = r < p.R;
    const T* src = gq;
    if (valid) {
      const int tok = p.pack ? r / p.G : r, head = p.pack ? hs * p.G + r % p.G : hs;
      src = gq + b * p.q_sb + tok * p.q_sr + head * p.q_sh + ch * 8;
    }
    cp_async_16(smem_addr(sQ + swz<DCH>(lr, ch)), src, valid);
  }
  cp_async_commit();
  int Nk = p.cache_seqlens[b] + p.seqlen_new;
  Nk = min(max(Nk, 0), p.capacity);  // invalid lengths cannot make the kernel read out of bounds

  // This lane's two fragment rows (gid, gid + 8): visible keys and thresholds.
  int L[2];
  float log_thr[1][2];
  for (int h = 0; h < 2; ++h) {
    const int r = qt * kDecodeBlockQ + gid + 8 * h;
    const int tok = p.pack ? r / p.G : r;
    L[h] = r < p.R ? rule::visible_keys(tok, p.Nq, Nk, p.causal != 0) : 0;
    log_thr[0][h] = row_log2_threshold(p.log2_tau, L[h]);
  }
  const int max_L = __reduce_max_sync(0xffffffffu, max(L[0], L[1]));

  const int n_tiles = rule::ceil_div(Nk, BK);
  int tb, te;
  rule::split_tiles(n_tiles, p.S, split, &tb, &te);
  const int te_l = min(te, rule::ceil_div(max_L, BK));  // legal tiles end
  const int n_own = max(te_l - tb, 0);

  // Seeded: the anchors [0] and [newest_lo, newest_hi] (newest_hi - newest_lo <= 1, see the
  // static_assert).  The split scores the ones outside [tb, te) first (iterations [0, na)), in the
  // order tile 0, newest_lo, newest_hi; a split without legal tiles scores none.
  const bool seeded = !kDense && p.seeded != 0;
  int newest_lo = 0, newest_hi = -1;
  if (seeded) {
    int lo = INT_MAX, hi = -1;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (L[h] > 0) {
        lo = min(lo, rule::newest_tile(L[h], BK));
        hi = max(hi, rule::newest_tile(L[h], BK));
      }
    newest_lo = __reduce_min_sync(0xffffffffu, lo);
    newest_hi = __reduce_max_sync(0xffffffffu, hi);
  }
  auto owned = [&](int j) { return j >= tb && j < te; };
  const bool sc0 = seeded && n_own > 0 && newest_lo > 0 && !owned(0);
  const bool sc1 = seeded && n_own > 0 && !owned(newest_lo);
  const bool sc2 = seeded && n_own > 0 && newest_hi > newest_lo && !owned(newest_hi);
  const int na = sc0 + sc1 + sc2;
  const int n_it = na + n_own;
  // Key tile of iteration it: the anchors, then the split's own tiles newest first.
  auto tile_of = [&](int it) {
    if (it >= na) return te_l - 1 - (it - na);
    if (sc0 && it == 0) return 0;
    return (sc1 && it == sc0) ? newest_lo : newest_hi;
  };
  auto forced = [&](int j) { return seeded && rule::is_anchor_tile(j, newest_lo, newest_hi); };
  uint8_t* mask = p.tile_mask ? p.tile_mask + (static_cast<int64_t>(b * p.HS + hs) * p.NQT + qt) * p.n_cap : nullptr;
  if (mask) {
    for (int j = max(te_l, tb) + tid; j < te; j += THREADS) mask[j] = kTileIllegal;
    for (int j = n_tiles + split + p.S * tid; j < p.n_cap; j += p.S * THREADS) mask[j] = kTileIllegal;
  }

  const T* gk = static_cast<const T*>(p.k_cache);
  const T* gv = static_cast<const T*>(p.v_cache);
  auto load_tile = [&](T* dst, const T* base, int64_t sb, int64_t sr, int64_t sh, int j) {
    decode_load_tile<T, D, BK, THREADS>(smem_addr(dst), base, sb, sr, sh, j, b, kvh, Nk, p.block_table, p.bt_stride,
                               p.page_size, p.page_shift, p.page_in_tile);
  };
  // Buffers: dense: K stages then V stages; sparse: slots, a retained tile's V in its K's slot.
  auto kbuf = [&](int it) { return bufs + (it % NST) * TILE; };
  auto vbuf = [&](int it) { return kDense ? bufs + (NST + it % NST) * TILE : kbuf(it); };
  auto pbuf = [&](int it) { return sP + (kDense ? 0 : it % NP) * kDecodeBlockQ * BK; };
  // K (and V when dense) of iteration it, as one commit group (an empty group past the end keeps the
  // group count of every iteration the same).
  auto issue = [&](int it) {
    if (it < n_it) {
      const int j = tile_of(it);
      load_tile(kbuf(it), gk, p.k_sb, p.k_sr, p.k_sh, j);
      if (kDense) load_tile(vbuf(it), gv, p.v_sb, p.v_sr, p.v_sh, j);
    }
    cp_async_commit();
  };

#pragma unroll 1
  for (int it = 0; it < AHEAD; ++it) issue(it);

  float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};
  float acc[NDF][4];
#pragma unroll
  for (int i = 0; i < NDF; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  int retained = 0;
  const int arow = (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix row of an A (Q or P) fragment
  // Q fragments: in registers where they fit (d <= 128: 32 registers), else re-read from shared
  // memory for every tile (d = 256).  The Q group precedes the AHEAD prologue groups.
  constexpr bool kQRegs = D <= 128;
  uint32_t qreg[kQRegs ? KS_QK : 1][4];
  if constexpr (kQRegs) {
    cp_async_wait<AHEAD>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < KS_QK; ++ks) ldmatrix_x4(qreg[ks], smem_addr(sQ + swz<DCH>(arow, ks * 2 + (lane >> 4))));
  }

  // O[:, warp dims] += P V for the P in `Ps` and the V in `Vs`.
  auto pv = [&](const T* Ps, const T* Vs) {
#pragma unroll
    for (int ks = 0; ks < KS_PV; ++ks) {
      uint32_t pa[4];
      ldmatrix_x4(pa, smem_addr(Ps + swz<BKCH>(arow, ks * 2 + (lane >> 4))));
#pragma unroll
      for (int n2 = 0; n2 < NDF / 2; ++n2) {
        const int vrow = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int vch = (warp * DW + n2 * 16) / 8 + (lane >> 4);
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, smem_addr(Vs + swz<DCH>(vrow, vch)));
        mma_16816<T>(acc[2 * n2], pa, vb);
        mma_16816<T>(acc[2 * n2 + 1], pa, vb + 2);
      }
    }
  };
  auto scale_acc = [&](const float (&f)[2]) {
#pragma unroll
    for (int i = 0; i < NDF; ++i) {
      acc[i][0] *= f[0];
      acc[i][1] *= f[0];
      acc[i][2] *= f[1];
      acc[i][3] *= f[1];
    }
  };
  // Sparse: acc is kept relative to m_basis, the m of the last tile whose PV has been added; a
  // deferred tile's P is relative to the m after its own update (m_slot).
  float m_basis[2] = {-INFINITY, -INFINITY};
  auto drain = [&](int it_d) {  // PV of the retained tile of iteration it_d (its V complete and visible)
    const float* ms = m_slot + (it_d % NP) * kDecodeBlockQ;
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mi = ms[gid + 8 * h];  // finite (m_use)
      f[h] = exp2f(m_basis[h] - mi);     // m_basis = -inf before the first tile: acc is 0 anyway
      m_basis[h] = mi;
    }
    scale_acc(f);
    pv(pbuf(it_d), vbuf(it_d));
  };
  // Seeded: (ma, la), the max and sum of the anchor tiles' scores (log2 units; set once, by the anchor
  // pass, through the same deferred update as l), and the test's denominator log_norm
  // (seeded_log2_norm of both pairs), refreshed whenever l or la changes (m changes only with l).
  // Per_split tests with warp_tile_skip_online on (m, l) directly.
  float ma[2] = {-INFINITY, -INFINITY}, la[2] = {0.f, 0.f};
  float log_norm[1][2] = {{-INFINITY, -INFINITY}};
  // l = l * alpha + the row sums of a retained tile's P from all warps (red_sum parity it_r & 1); la
  // likewise for the anchors' exp2 sums (it_r = na - 1: the anchor pass).  Sparse: it waits for the
  // next top barrier; pend_l / alpha_l carry it.
  bool pend_l = false;
  float alpha_l[2] = {1.f, 1.f};
  auto apply_l = [&](int it_r) {
    const float* rs = red_sum + (it_r & 1) * W * kDecodeBlockQ;
    const bool anchor = it_r < na;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = cta_row_reduce<W, false>(rs + (gid + 8 * h) * W);
      if (anchor) la[h] = la[h] * alpha_l[h] + sum;
      else l[0][h] = l[0][h] * alpha_l[h] + sum;
      if (seeded) log_norm[0][h] = seeded_log2_norm(log2_norm(ma[h], la[h]), m[0][h], l[0][h]);
    }
  };
  uint32_t pend_pv = 0;  // sparse: bit d set = the tile of iteration it - 1 - d awaits its PV

  // S = Q K^T for this warp's keys of the tile in Ks (key tile j), in log2 units, keys a row does
  // not see at -inf; mx: this warp's row maxima, reduced over the quad.
  auto score = [&](const T* Ks, int j, float (&sc)[NF][4], float (&mx)[2]) {
#pragma unroll
    for (int i = 0; i < NF; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS_QK; ++ks) {
      uint32_t qs[4];
      if constexpr (!kQRegs) ldmatrix_x4(qs, smem_addr(sQ + swz<DCH>(arow, ks * 2 + (lane >> 4))));
      const uint32_t* qf = kQRegs ? qreg[ks] : qs;
#pragma unroll
      for (int n2 = 0; n2 < NF / 2; ++n2) {
        const int krow = warp * KW + n2 * 16 + (lane & 7) + (lane >> 4) * 8;
        uint32_t kb[4];
        ldmatrix_x4(kb, smem_addr(Ks + swz<DCH>(krow, ks * 2 + ((lane >> 3) & 1))));
        mma_16816<T>(sc[2 * n2], qf, kb);
        mma_16816<T>(sc[2 * n2 + 1], qf, kb + 2);
      }
    }
    const int key0 = j * BK + warp * KW + tig * 2;
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, key = key0 + nf * 8 + (e & 1);
        sc[nf][e] = key < L[h] ? sc[nf][e] * p.scale_log2 : -INFINITY;
        mx[h] = rule::nan_max(mx[h], sc[nf][e]);
      }
    mx[0] = warp_max_quad(mx[0]);
    mx[1] = warp_max_quad(mx[1]);
  };

  // Seeded: the anchor tiles (iterations [0, na), at most 3) in one pass before the loop: their K
  // (the oldest prologue groups), one barrier, every warp scores its keys of each, one row-max
  // exchange for all of them, and their exact mass (ma, la) from that one maximum.  One pass
  // instead of one iteration per anchor: where a split owns only a few tiles (batch 1, short
  // caches) the anchors' barriers and exchanges were a third of its iterations.  It then commits
  // the groups those iterations would have (an empty V group, K of the tile AHEAD ahead, issued
  // once every warp is past its QK), so the loop's group counts hold from iteration na on.
  int it_begin = 0;
  if (!kDense && na > 0) {
    cp_async_wait_dyn(AHEAD - na);  // na <= 3 <= AHEAD
    __syncthreads();
    float sca[3][NF][4];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int a = 0; a < 3; ++a)
      if (a < na) score(kbuf(a), tile_of(a), sca[a], mx);
    float tmax[1][2];
    cta_row_max_exchange<W>(mx, red_max, warp, gid, tig, tmax);
    float psa[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = rule::nan_max(ma[h], tmax[0][h]);
      const float mu = m_new == -INFINITY ? 0.f : m_new;
      alpha_l[h] = exp2f(ma[h] - mu);
      ma[h] = m_new;
#pragma unroll
      for (int a = 0; a < 3; ++a)
        if (a < na)
#pragma unroll
          for (int nf = 0; nf < NF; ++nf)
            psa[h] += exp2f(sca[a][nf][2 * h] - mu) + exp2f(sca[a][nf][2 * h + 1] - mu);
      psa[h] = warp_sum_quad(psa[h]);
    }
    float* rs = red_sum + ((na - 1) & 1) * W * kDecodeBlockQ;  // read by apply_l(na - 1)
    if (tig == 0) {
      rs[gid * W + warp] = psa[0];
      rs[(gid + 8) * W + warp] = psa[1];
    }
    pend_l = true;
#pragma unroll 1
    for (int a = 0; a < na; ++a) {
      cp_async_commit();
      issue(a + AHEAD);
    }
    it_begin = na;
  }

  for (int it = it_begin; it < n_it; ++it) {
    const int j = tile_of(it);
    if (kDense) {
      cp_async_wait<NST - 2>();
    } else {
      // Groups committed so far: Q, the AHEAD prologue groups K(0) .. K(AHEAD - 1), then two per
      // iteration (V of the tile if retained, else empty; K of the tile AHEAD ahead).  K(it) must be
      // complete (AHEAD - 1 + it newer groups in the prologue, 2 (AHEAD - 1) after it), and V of the
      // tile to drain (iteration it - DEFER, its first group: 2 DEFER - 1 newer, fewer than K(it)'s
      // since AHEAD >= DEFER) if any.  Constant counts outside the prologue: the wait is on the
      // critical path of every tile.
      if (pend_pv & (1u << (DEFER - 1))) cp_async_wait<2 * DEFER - 1>();
      else if (it >= AHEAD - 1) cp_async_wait<2 * (AHEAD - 1)>();
      else cp_async_wait_dyn(AHEAD - 1 + it);
    }
    __syncthreads();  // K(it) (and V of the tile to drain) visible; previous buffers, P slots, red_* free
    if (kDense) issue(it + AHEAD);
    if (!kDense) {
      if (pend_l) apply_l(it - 1);
      pend_l = false;
      if (pend_pv & (1u << (DEFER - 1))) drain(it - DEFER);
      pend_pv = (pend_pv << 1) & ((1u << DEFER) - 1);
    }

    float sc[NF][4];
    float mx[2] = {-INFINITY, -INFINITY};
    score(kbuf(it), j, sc, mx);
    float tmax[1][2];
    cta_row_max_exchange<W>(mx, red_max, warp, gid, tig, tmax);
    // The tile test (identical inputs in every warp, so every warp takes the same decision); seeded,
    // owned anchors are kept untested.
    bool skip = false;
    if (!kDense && !forced(j))
      skip = seeded ? warp_tile_skip_norm<1>(tmax, log_norm, log_thr) : warp_tile_skip_online<1>(tmax, m, l, log_thr);
    if (mask && tid == 0) mask[j] = skip ? kTileSkipped : kTileRetained;
    if (!kDense) {
      // V only after the test, into the slot K(it) has left (every warp is past its QK: the barrier
      // of the row-max exchange); one group per iteration even when skipped.
      if (!skip) load_tile(vbuf(it), gv, p.v_sb, p.v_sr, p.v_sh, j);
      cp_async_commit();
      issue(it + AHEAD);
    }
    if (skip) continue;
    ++retained;

    // Online softmax update; P -> shared.
    float alpha[2], psum[2] = {0.f, 0.f}, m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = rule::nan_max(m[0][h], tmax[0][h]);
      m_use[h] = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = exp2f(m[0][h] - m_use[h]);
      m[0][h] = m_new;
    }
    T* Pw = pbuf(it);
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
      const float p0 = exp2f(sc[nf][0] - m_use[0]), p1 = exp2f(sc[nf][1] - m_use[0]);
      const float p2 = exp2f(sc[nf][2] - m_use[1]), p3 = exp2f(sc[nf][3] - m_use[1]);
      psum[0] += p0 + p1;
      psum[1] += p2 + p3;
      const int col = warp * KW + nf * 8 + tig * 2;
      *reinterpret_cast<uint32_t*>(Pw + swz<BKCH>(gid, col >> 3) + (col & 7)) = pack2<T>(p0, p1);
      *reinterpret_cast<uint32_t*>(Pw + swz<BKCH>(gid + 8, col >> 3) + (col & 7)) = pack2<T>(p2, p3);
    }
    psum[0] = warp_sum_quad(psum[0]);
    psum[1] = warp_sum_quad(psum[1]);
    float* rs = red_sum + (kDense ? 0 : (it & 1) * W * kDecodeBlockQ);
    if (tig == 0) {
      rs[gid * W + warp] = psum[0];
      rs[(gid + 8) * W + warp] = psum[1];
    }
    if (!kDense) {
      // Deferred: l at the next top barrier, PV DEFER iterations later (or after the loop).
      if (warp == 0 && tig == 0) {
        m_slot[(it % NP) * kDecodeBlockQ + gid] = m_use[0];
        m_slot[(it % NP) * kDecodeBlockQ + gid + 8] = m_use[1];
      }
      alpha_l[0] = alpha[0];
      alpha_l[1] = alpha[1];
      pend_l = true;
      pend_pv |= 1u;
      continue;
    }
    scale_acc(alpha);
    alpha_l[0] = alpha[0];
    alpha_l[1] = alpha[1];
    __syncthreads();  // P, red_sum and V visible
    apply_l(0);       // (the dense variant has one red_sum buffer: parity 0)
    m_basis[0] = m_use[0];
    m_basis[1] = m_use[1];
    pv(Pw, vbuf(it));
  }
  cp_async_wait<0>();  // nothing may stay in flight into exited shared memory
  if (!kDense) {
    __syncthreads();  // the last V slots, P slots, m slots and row sums visible
    if (pend_l) apply_l(n_it - 1);  // (the last iteration is an own tile: na > 0 needs n_own > 0)
#pragma unroll
    for (int d = DEFER - 1; d >= 0; --d)
      if (pend_pv & (1u << d)) drain(n_it - 1 - d);
  }
  // acc is relative to the final m: m only changes on retained tiles and the last PV'd tile is the
  // last retained one (rows without a finite m have acc = 0).

  // Epilogue.
  if (p.S == 1) {
    T* go = static_cast<T*>(p.o);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = qt * kDecodeBlockQ + gid + 8 * h;
      if (r >= p.R) continue;
      const int tok = p.pack ? r / p.G : r, head = p.pack ? hs * p.G + r % p.G : hs;
      const float inv = l[0][h] == 0.f ? 0.f : 1.f / l[0][h];  // NaN l: NaN o
      T* orow = go + b * p.o_sb + tok * p.o_sr + head * p.o_sh + warp * DW + tig * 2;
#pragma unroll
      for (int i = 0; i < NDF; ++i)
        *reinterpret_cast<uint32_t*>(orow + i * 8) = pack2<T>(acc[i][2 * h] * inv, acc[i][2 * h + 1] * inv);
      if (warp == 0 && tig == 0) {
        const int64_t idx = (static_cast<int64_t>(b) * p.Hq + head) * p.Nq + tok;
        if (p.lse) p.lse[idx] = l[0][h] == 0.f ? -INFINITY : log2_norm(m[0][h], l[0][h]) * rule::kLn2;
        if (p.slots) p.slots[idx] = L[h] > 0 ? retained * BK : 0;
      }
    }
  } else {
    const int64_t idx = ((static_cast<int64_t>(b) * p.HS + hs) * p.NQT + qt) * p.S + split;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = gid + 8 * h;
      const float inv = l[0][h] == 0.f ? 0.f : 1.f / l[0][h];  // NaN l: NaN o
      float* wrow = p.ws_o + (idx * kDecodeBlockQ + lr) * D + warp * DW + tig * 2;
#pragma unroll
      for (int i = 0; i < NDF; ++i)
        *reinterpret_cast<float2*>(wrow + i * 8) = make_float2(acc[i][2 * h] * inv, acc[i][2 * h + 1] * inv);
      if (warp == 0 && tig == 0)
        p.ws_lse[idx * kDecodeBlockQ + lr] = l[0][h] == 0.f ? -INFINITY : log2_norm(m[0][h], l[0][h]);
    }
    if (tid == 0) p.ws_cnt[idx] = retained;
  }
}

}  // namespace cuda
}  // namespace mala

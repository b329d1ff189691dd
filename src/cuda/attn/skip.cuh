// The MALA tile test applied to mma fragments, and the votes that turn the rows' tests into one
// decision per tile.  The rule itself is rule::row_allows_skip (src/common/rule.h); this file gathers
// its inputs from fragments (the per-row threshold, the lanes' row maxima) and votes.
//
// The vote kinds (a tile is skipped iff every row of its decision tile allows it):
//   warp_vote_skip        one warp owns the decision tile: __all_sync (mma.sync forward, the
//                         128-key forward at d = 128, decode after the exchange below)
//   pair_vote_popc        a warp pair owns it (the 128-key forward at d = 64 and 256): one
//                         bar.red.popc over the warpgroup, whose count carries both pairs' decisions
//   cta_vote_mbarrier     the CTA owns it (backward): flags and an mbarrier that only warps that
//                         would skip wait on (cta_vote_arrive / cta_vote_result: the same with
//                         tagged words, for the warp-specialized backward)
//   barrier_vote_or       the CTA owns it and every warp waits anyway (the warp-specialized
//                         backward after a skipped tile): one bar.red.or; also whether a warpgroup
//                         runs a tile its warps decided alone (the 128-key forward at d = 128)
//   cta_row_max_exchange  the CTA's warps split the tile's keys (decode): the row maxima through
//                         shared memory, so every warp takes the same decision
//   warpgroup_vote_words  a warpgroup owns it and the warpgroups meet at a barrier anyway (the d = 256
//                         key-major backward, at its P^T / dS^T store barrier): each warp's verdict
//                         in a word, every warpgroup's decision read back after the barrier
//
// Fragment rows: with m16n8k16 C fragments a lane holds rows g and g+8 (g = lane / 4) of each m16
// tile, and the four lanes of a quad hold the same rows.  Arrays indexed [mt][h] refer to row
// 16*mt + g + 8*h of the warp's block.  All values are in the log2 domain in the kernels:
//   tile_max = scale*log2(e) * max over the row's legal keys in the tile (-inf when none),
//   log_norm = m + log2(l) of the running state (online rule) or the saved lse*log2(e) (offline),
//   log_thr  = log2(tau) - log2(L_q)  (rule::log_threshold).
// A row that has no legal key in the tile (tile_max = -inf, also rows past seqlen_q) never blocks a
// skip; a row with nothing retained yet (l = 0 -> log_norm = -inf) always blocks it.
#pragma once

#include <math.h>

#include "common/rule.h"
#include "cuda/attn/online_softmax.cuh"
#include "cuda/core/ptx.cuh"

namespace mala {
namespace cuda {

// log2(tau / L_q) of a row that sees L > 0 keys (rule::log_threshold in base 2; the online tests).
__device__ __forceinline__ float row_log2_threshold(float log2_tau, int L) {
  return rule::log_threshold(log2_tau, __log2f(static_cast<float>(L)));
}
// The same, +inf for a row that sees no key, which then never blocks a skip (the backward's offline
// test, whose rows are tested without their tile max's -inf case).
__device__ __forceinline__ float row_log2_threshold_or_inf(float log2_tau, int L) {
  return L > 0 ? row_log2_threshold(log2_tau, L) : INFINITY;
}

// One level of lane_row_max's tree and the levels below it: x[i] = max(x[i], x[i + W]) for i < W.
// (Recursion on a constant W: a loop over w /= 2 stays rolled at 16 entries, and ptxas then keeps
// the arrays in local memory.)
template <int W, int N>
__device__ __forceinline__ void lane_row_max_fold(float (&ra)[N], float (&rb)[N]) {
#pragma unroll
  for (int i = 0; i < W; ++i) {
    ra[i] = rule::nan_max(ra[i], ra[i + W]);
    rb[i] = rule::nan_max(rb[i], rb[i + W]);
  }
  if constexpr (W > 1) lane_row_max_fold<W / 2>(ra, rb);
}

// Max of this lane's entries of rows (g, g + 8) of m16 tile mt of a score fragment s[MT][NT][4]
// (raw or scaled; masked entries -inf), before the reduction over the quad.  NaN propagates
// (rule::nan_max, here and in every row-max reduction of the kernels): a row with a NaN score has a
// NaN max, which blocks every skip test, as on the CPU.
// A balanced tree (depth log2(2 NT) instead of a chain of 2 NT maxes: this sits on the path from the
// scores to the skip decision).
template <int MT, int NT>
__device__ __forceinline__ void lane_row_max(const float (&s)[MT][NT][4], int mt, float& a, float& b) {
  static_assert((NT & (NT - 1)) == 0, "lane_row_max: NT must be a power of two");
  float ra[NT], rb[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    ra[nt] = rule::nan_max(s[mt][nt][0], s[mt][nt][1]);
    rb[nt] = rule::nan_max(s[mt][nt][2], s[mt][nt][3]);
  }
  lane_row_max_fold<NT / 2>(ra, rb);
  a = ra[0];
  b = rb[0];
}
// The reduction of lane_row_max's parts over the quad, in place: afterwards every lane of the quad
// holds the row's max.  (The forward kernels vote on the parts and reduce only for a retained tile.)
template <int MT>
__device__ __forceinline__ void quad_row_max(float (&x)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    x[mt][0] = warp_max_quad(x[mt][0]);
    x[mt][1] = warp_max_quad(x[mt][1]);
  }
}

// True when every fragment row held by this lane allows the skip (no vote).
// tile_max, log_norm, log_thr: [MT][2] as above, log2 domain.
template <int MT>
__device__ __forceinline__ bool lane_rows_allow_skip(const float (&tile_max)[MT][2], const float (&log_norm)[MT][2],
                                                     const float (&log_thr)[MT][2]) {
  bool ok = true;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) ok &= rule::row_allows_skip(tile_max[mt][h], log_norm[mt][h], log_thr[mt][h]);
  return ok;
}

// True when some fragment row held by this lane blocks the skip, from the lane's part of each row's
// raw (unscaled) max and the rows' bounds (rule::skip_bound_raw: one comparison per row).
template <int MT>
__device__ __forceinline__ bool lane_rows_block_skip_raw(const float (&raw_max)[MT][2], const float (&bound)[MT][2]) {
  bool block = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) block |= !rule::row_allows_skip_raw(raw_max[mt][h], bound[mt][h]);
  return block;
}

// Warp vote: true iff every lane allows the skip.  The decision is then uniform over the warp, as
// the mma needs (use __syncthreads_and instead when the whole CTA must agree).
__device__ __forceinline__ bool warp_vote_skip(bool lane_ok) { return __all_sync(0xffffffffu, lane_ok); }

// The online (forward/decode) test for a warp-owned block of 16*MT rows: log_norm = m + log2(l)
// from the running state (m in scaled log2 units, l the full row sum, reduced over the quad).
// Returns the warp-uniform decision: true = skip the post-score work of this tile.
template <int MT>
__device__ __forceinline__ bool warp_tile_skip_online(const float (&tile_max)[MT][2], const float (&m)[MT][2],
                                                      const float (&l)[MT][2], const float (&log_thr)[MT][2]) {
  float log_norm[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) log_norm[mt][h] = log2_norm(m[mt][h], l[mt][h]);  // l = 0 -> -inf
  return warp_vote_skip(lane_rows_allow_skip<MT>(tile_max, log_norm, log_thr));
}

// The same test against a denominator the caller keeps (the seeded decode refreshes it only when its
// running mass changes): log_norm [MT][2], log2 domain.
template <int MT>
__device__ __forceinline__ bool warp_tile_skip_norm(const float (&tile_max)[MT][2], const float (&log_norm)[MT][2],
                                                    const float (&log_thr)[MT][2]) {
  return warp_vote_skip(lane_rows_allow_skip<MT>(tile_max, log_norm, log_thr));
}
// The seeded split-KV denominator (docs/spec.md, "Split rules") in the kernels' base 2:
// log2(2^log2_anchor + 2^m l), rule::log_add_exp carried over from natural logs.  log2_anchor = -inf
// (no anchor mass) gives m + log2(l) up to rounding; nothing at all gives -inf.
__device__ __forceinline__ float seeded_log2_norm(float log2_anchor, float m, float l) {
  return rule::log_add_exp(log2_anchor * rule::kLn2, log2_norm(m, l) * rule::kLn2) * (1.f / rule::kLn2);
}

// ---- votes over more than one warp ------------------------------------------------------------------

// pair_vote_popc: barrier `id` over `nthreads` threads that returns how many passed a predicate, in
// one asm block: the predicate is the warp's any over its lanes' lane_pred, on the lanes where
// `counted` is nonzero (the warp vote and the barrier's predicate stay predicates, with no conversion
// through a register).  The 128-key forward counts every lane of a retaining pair-0 warp
// (32) and lane 0 of a retaining pair-1 warp (1): pair 0's count is a multiple of 32, pair 1's below
// 32.  bar.red defers blocking to the read of its result, so the caller can work in between.
__device__ __forceinline__ uint32_t pair_vote_popc(int id, int nthreads, bool lane_pred, uint32_t counted) {
  uint32_t count;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n vote.sync.any.pred p, p, 0xffffffff;\n"
      " setp.ne.and.u32 p, %2, 0, p;\n bar.red.popc.u32 %0, %3, %4, p;\n}\n"
      : "=r"(count)
      : "r"((uint32_t)lane_pred), "r"(counted), "r"(id), "r"(nthreads)
      : "memory");
  return count;
}

// The offline test on S^T fragments (apply_mask_keys_x_rows' layout, NT n8 tiles of query rows):
// whether one of this thread's entries reaches its query row's raw-score bound
// (rule::row_allows_skip_raw; bound[r] is the bound of the tile's query row r).
template <int NT>
__device__ __forceinline__ bool keys_x_rows_blocks_skip(const float (&s)[4 * NT], const float* bound, int lane) {
  bool block = false;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c)
      block |= !rule::row_allows_skip_raw(rule::nan_max(s[4 * n + c], s[4 * n + 2 + c]), bound[n * 8 + 2 * (lane & 3) + c]);
  return block;
}

// warpgroup_vote_words: warp `warp` publishes its verdict (whether one of its entries blocks the skip,
// uniform over the warp) into words[warp] before the caller's barrier ...
__device__ __forceinline__ void warpgroup_vote_publish(uint32_t* words, int warp, int lane, bool warp_retain) {
  if (lane == 0) words[warp] = warp_retain ? 1u : 0u;
}
// ... and after it, warpgroup g's decision: whether one of words 4g .. 4g + 3 is set.  Through
// __any_sync, so that ptxas knows it to be warp-uniform and compiles the branches around the wgmmas
// that depend on it without divergence handling.
__device__ __forceinline__ bool warpgroup_vote_result(const uint32_t* words, int g) {
  const uint4 v = *reinterpret_cast<const uint4*>(words + 4 * g);
  return __any_sync(0xffffffffu, (v.x | v.y | v.z | v.w) != 0u);
}

// barrier_vote_or: barrier `id` over `nthreads` threads that returns whether any passed `pred` (one
// bar.red.or; like pair_vote_popc it blocks only where its result is read).
__device__ __forceinline__ bool barrier_vote_or(int id, int nthreads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred p, %2, %3, p;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(any)
      : "r"((uint32_t)pred), "r"(id), "r"(nthreads)
      : "memory");
  return any != 0u;
}

// cta_vote_mbarrier: the CTA's decision on iteration t (backward), from this warp's warp_retain (some
// entry of the warp blocks the skip).  Each warp ORs its vote into vote_s[st] and arrives on mbarrier
// st (of two, used alternately).  A warp that retains knows the outcome (one retaining entry keeps
// the tile) and does not wait; only warps that would skip wait for the 8 arrivals, so on inputs where
// nearly every tile is kept the vote costs no barrier.  vote_s[st ^ 1] is reset by thread 0 after each
// top barrier (the caller's).
__device__ __forceinline__ bool cta_vote_mbarrier(bool warp_retain, uint32_t* vote_s, uint32_t mbar_s, int st, int t) {
  if ((threadIdx.x & 31) == 0) {
    if (warp_retain) atomicOr(&vote_s[st], 1u);
    mbar_arrive(mbar_s + st * 8);
  }
  if (warp_retain) return true;
  mbar_wait(mbar_s + st * 8, (t >> 1) & 1);
  return *reinterpret_cast<volatile uint32_t*>(&vote_s[st]) != 0u;
}

// cta_vote_arrive / cta_vote_result: cta_vote_mbarrier for kernels without a CTA-wide barrier per
// iteration (the warp-specialized backward, whose 8 consumer warps vote), in two halves so that work
// can be issued between them: a ring of 4 words and mbarriers indexed by t, each word tagged with
// t + 1 by the retaining warps, so that nothing has to reset it.  A warp that retains knows the
// outcome and does not call cta_vote_result.  The warps stay within a tile or two of each other
// (every tile's Q slot is given back by all of them before the producer refills it), so a slot is
// never reused while a warp still reads it.
__device__ __forceinline__ void cta_vote_arrive(bool warp_retain, uint32_t* words, uint32_t mbar0, int t, int lane) {
  const int slot = t & 3;
  if (lane == 0) {
    if (warp_retain) *reinterpret_cast<volatile uint32_t*>(&words[slot]) = static_cast<uint32_t>(t + 1);
    mbar_arrive(mbar0 + 8 * slot);
  }
}
__device__ __forceinline__ bool cta_vote_result(uint32_t* words, uint32_t mbar0, int t) {
  const int slot = t & 3;
  mbar_wait(mbar0 + 8 * slot, static_cast<uint32_t>(t >> 2) & 1u);
  return *reinterpret_cast<volatile uint32_t*>(&words[slot]) == static_cast<uint32_t>(t + 1);
}

// cta_row_max_exchange: the tile max of this lane's two rows (gid, gid + 8) over the CTA's W warps,
// each of which scored a slice of the tile's keys (decode): mx is this warp's quad-reduced row max,
// red_max [16 rows][W warps] in shared memory (16-byte aligned; a row's W values are read as
// float4s); one barrier.  Every warp then holds the same tile_max and takes the same decision.
// cta_row_reduce: the max (kMax) or the sum of one row's W per-warp values.
template <int W, bool kMax>
__device__ __forceinline__ float cta_row_reduce(const float* row) {
  static_assert(W % 4 == 0, "whole float4s per row");
  float t = kMax ? -INFINITY : 0.f;
#pragma unroll
  for (int w = 0; w < W; w += 4) {
    const float4 v = *reinterpret_cast<const float4*>(row + w);
    t = kMax ? rule::nan_max(rule::nan_max(t, v.x), rule::nan_max(v.y, rule::nan_max(v.z, v.w)))
             : t + ((v.x + v.y) + (v.z + v.w));
  }
  return t;
}

template <int W>
__device__ __forceinline__ void cta_row_max_exchange(const float (&mx)[2], float* red_max, int warp, int gid, int tig,
                                                     float (&tile_max)[1][2]) {
  if (tig == 0) {
    red_max[gid * W + warp] = mx[0];
    red_max[(gid + 8) * W + warp] = mx[1];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) tile_max[0][h] = cta_row_reduce<W, true>(red_max + (gid + 8 * h) * W);
}

}  // namespace cuda
}  // namespace mala

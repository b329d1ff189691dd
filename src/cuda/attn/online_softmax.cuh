// Online softmax on mma fragments (FlashAttention-2 style), base 2 with the softmax scale folded
// into one FMA: p = exp2(s * scale_log2 - m), scale_log2 = softmax_scale * log2(e).
//
// State per fragment row ([mt][h], see skip.cuh): m = the exponent base in scaled log2 units
// (the running max, or up to kRescaleSlack below it under the lazy rescale; -inf before anything is
// retained), l = running sum of exp2(s*scale_log2 - m) over retained keys, kept fully reduced over
// the quad where a tile test needs the whole row sum, and the output accumulator acc[MT][DT][4] (C
// fragments of the m16 x (8*DT) output block).  Scores s[MT][NT][4] arrive raw (q.k) with masked
// entries at -inf; after softmax_step_or_keep (or softmax_scores) they hold the unnormalised
// probabilities P, ready to be packed into A fragments (p_to_a) for P V.
#pragma once

#include <math.h>

#include "common/rule.h"
#include "cuda/core/ptx.cuh"

namespace mala {
namespace cuda {

// The row's normaliser in log2 units, m + log2(l): what the online test compares against
// (-inf while nothing is retained, l = 0), and lse / ln 2 at the end.
__device__ __forceinline__ float log2_norm(float m, float l) { return m + __log2f(l); }

template <int MT, int DT>
__device__ __forceinline__ void softmax_init(float (&m)[MT][2], float (&l)[MT][2], float (&acc)[MT][DT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.f;
  }
}

// The exponent base of a row's P after a tile: its base m, or 0 where no key is legal yet (m = -inf,
// so that P = exp2(-inf) = 0 rather than NaN); +inf (P = 0) for rows that keep = false leaves alone.
__device__ __forceinline__ float softmax_p_base(float m, bool keep) {
  const float b = m == -INFINITY ? 0.f : m;
  return keep ? b : INFINITY;
}
// The two halves of a tile's update, for one row and one m16 block: softmax_row_max gives the row's
// new running maximum and the exponent base of its P (keep = false: the maximum stays and P = 0);
// softmax_exponentiate turns s into P = exp2(s*scale_log2 - base) and sums this lane's part of
// each row.
__device__ __forceinline__ void softmax_row_max(float m_old, float tile_max_raw, float scale_log2, bool keep,
                                                float& m_new, float& base) {
  m_new = rule::nan_max(m_old, tile_max_raw * scale_log2);
  base = softmax_p_base(m_new, true);
  if (!keep) {
    m_new = m_old;
    base = INFINITY;
  }
}
template <int NT>
__device__ __forceinline__ void softmax_exponentiate(float (&s)[NT][4], const float (&base)[2], float scale_log2,
                                                     float (&sum)[2]) {
  sum[0] = sum[1] = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float p = exp2f(fmaf(s[nt][e], scale_log2, -base[e >> 1]));
      s[nt][e] = p;
      sum[e >> 1] += p;
    }
}

// O's rows times alpha = exp2(m_old - m_new), the factor of a row whose base moved (kernels that
// overlap the exponentials with an in-flight P V of the previous tile apply it once that P V has
// completed).
template <int MT, int DT>
__device__ __forceinline__ void softmax_rescale(const float (&alpha)[MT][2], float (&acc)[MT][DT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      acc[mt][dt][0] *= alpha[mt][0];
      acc[mt][dt][1] *= alpha[mt][0];
      acc[mt][dt][2] *= alpha[mt][1];
      acc[mt][dt][3] *= alpha[mt][1];
    }
}
// A row's exponent base moves only when its maximum grows by more than kRescaleSlack (log2 units),
// so that O and l are rescaled only then (the lazy rescale of FlashAttention-4).  Between two moves
// P = exp2(s * scale_log2 - base) <= 2^kRescaleSlack, which fp32 accumulators and bf16/fp16 P hold
// with their usual relative precision; O / l and base + log2(l) (lse, the test's normaliser) are the
// same numbers up to rounding, whatever base is.
constexpr float kRescaleSlack = 8.f;
// The lazy rescale's rule for one row: whether its base moves to the tile's scaled maximum cand.
// -inf + slack is -inf: a row's first legal scores always move it.  (Bitwise & and a select: a
// short-circuit && on keep made ptxas branch around each row's update.)
__device__ __forceinline__ bool softmax_lazy_move(float m_old, float cand, bool keep) {
  return (cand > m_old + kRescaleSlack) & keep;
}

// The update shared by softmax_step_or_keep and softmax_step_deferred (below): m, l and s -> P; where
// some row of the warp moved its base (warp-uniform), the factors alpha go to on_grew(alpha) inside
// that branch (alpha = 1 exactly for the rows that did not move) and this returns true.
// kDeferSum (with kQuadSum; softmax_step_deferred): where no base moved, l is left as it was and
// part gets this lane's parts of the tile's row sums, for the caller's softmax_add_deferred_sum;
// where one moved, l is updated here and part is 0.
template <int MT, int NT, bool kQuadSum, bool kDeferSum = false, typename OnGrew>
__device__ __forceinline__ bool softmax_step_update(float (&s)[MT][NT][4], const float (&tile_max_raw)[MT][2],
                                                    float scale_log2, bool keep, float (&m)[MT][2], float (&l)[MT][2],
                                                    OnGrew&& on_grew, float (*part)[2] = nullptr) {
  static_assert(kQuadSum || !kDeferSum, "a deferred sum is reduced over the quad");
  float base[MT][2], m_old[MT][2], sum[MT][2];
  bool grew = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_old[mt][h] = m[mt][h];
      const float cand = tile_max_raw[mt][h] * scale_log2;
      const bool move = softmax_lazy_move(m_old[mt][h], cand, keep);
      m[mt][h] = move ? cand : m_old[mt][h];
      base[mt][h] = softmax_p_base(m[mt][h], keep);
      grew |= move;
    }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) softmax_exponentiate<NT>(s[mt], base[mt], scale_log2, sum[mt]);
  if (__any_sync(0xffffffffu, grew)) {
    float alpha[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        alpha[mt][h] = keep ? exp2f(m_old[mt][h] - base[mt][h]) : 1.f;
        l[mt][h] = fmaf(l[mt][h], alpha[mt][h], kQuadSum ? warp_sum_quad(sum[mt][h]) : sum[mt][h]);
        if constexpr (kDeferSum) part[mt][h] = 0.f;
      }
    on_grew(alpha);
    return true;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kDeferSum)
        part[mt][h] = sum[mt][h];
      else
        l[mt][h] += kQuadSum ? warp_sum_quad(sum[mt][h]) : sum[mt][h];
    }
  return false;
}

// softmax_step_or_keep without the rescale of acc, for kernels whose acc is still being written by the
// previous tile's P V while this tile's exponentials run (fwd/sm90_consumer.cuh): the factors go to
// alpha, which the caller applies with softmax_rescale once that P V has completed -- only when this
// returns true (alpha is not set otherwise).
// kDeferSum (with kQuadSum): the quad reduction of the tile's row sums and their addition to l are
// left to the caller where no base moved (the common tile): part gets this lane's parts, and
// softmax_add_deferred_sum(l, part), run later (fwd/sm90_consumer.cuh: once the next tile's
// wgmmas are issued), leaves l bit for bit as without kDeferSum (the same sum added to the same l).
// Where a base moved, l is updated here and part = 0, which adds nothing (l + 0 = l, flush-to-zero
// included: l is 0 or at least 1, the key that set the base having P = 1).
template <int MT, int NT, bool kQuadSum = true, bool kDeferSum = false>
__device__ __forceinline__ bool softmax_step_deferred(float (&s)[MT][NT][4], const float (&tile_max_raw)[MT][2],
                                                      float scale_log2, bool keep, float (&m)[MT][2],
                                                      float (&l)[MT][2], float (&alpha)[MT][2],
                                                      float (*part)[2] = nullptr) {
  return softmax_step_update<MT, NT, kQuadSum, kDeferSum>(
      s, tile_max_raw, scale_log2, keep, m, l,
      [&](const float(&a)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) alpha[mt][0] = a[mt][0], alpha[mt][1] = a[mt][1];
      },
      part);
}
template <int MT>
__device__ __forceinline__ void softmax_add_deferred_sum(float (&l)[MT][2], const float (&part)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) l[mt][h] += warp_sum_quad(part[mt][h]);
}

// softmax_step_or_keep: one tile's update of MT m16 blocks, with the lazy rescale above: only rows
// whose maximum grew by more than kRescaleSlack take the new maximum as their base, and alpha and
// the rescale of acc run only when some row of the warp did (a warp-uniform branch; the other rows
// get alpha = 1 exactly).  On long rows a maximum seldom grows that much after the first tile
// (random scores: never after it; real models: at the attention-sink tile), so almost every tile
// skips the 2 D / 4 multiplies per m16 block of acc and the exponentials of alpha.
// keep = false (a skipped pair whose warpgroup runs P V anyway): P = 0 and m, l and acc stay bit for
// bit as they were, so one path serves both decisions.
// kQuadSum = false (dense instances, which have no test to feed): l holds this lane's part of the
// row sum, to be reduced over the quad (warp_sum_quad) once, before the epilogue.
template <int MT, int NT, int DT, bool kQuadSum = true>
__device__ __forceinline__ void softmax_step_or_keep(float (&s)[MT][NT][4], const float (&tile_max_raw)[MT][2],
                                                     float scale_log2, bool keep, float (&m)[MT][2], float (&l)[MT][2],
                                                     float (&acc)[MT][DT][4]) {
  softmax_step_update<MT, NT, kQuadSum>(s, tile_max_raw, scale_log2, keep, m, l,
                                       [&](const float(&alpha)[MT][2]) { softmax_rescale<MT, DT>(alpha, acc); });
}

// The row sums that softmax_step_or_keep<.., false> left per lane, reduced over the quad (before the
// epilogue).
template <int MT>
__device__ __forceinline__ void softmax_quad_row_sums(float (&l)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) l[mt][h] = warp_sum_quad(l[mt][h]);
}

// A fragment (16 rows x keys 16*kk..16*kk+15) of P for m16 tile mt, from the C fragments of n8
// tiles 2kk and 2kk+1.
template <typename T, int MT, int NT>
__device__ __forceinline__ void p_to_a(const float (&p)[MT][NT][4], int mt, int kk, uint32_t (&a)[4]) {
  a[0] = pack2<T>(p[mt][2 * kk][0], p[mt][2 * kk][1]);
  a[1] = pack2<T>(p[mt][2 * kk][2], p[mt][2 * kk][3]);
  a[2] = pack2<T>(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
  a[3] = pack2<T>(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
}

// Final normalisation: acc /= l (0 where l = 0) and the natural-log lse = (m + log2 l) * ln 2
// (-inf where l = 0; NaN where l is NaN).
template <int MT, int DT>
__device__ __forceinline__ void softmax_finalize(const float (&m)[MT][2], const float (&l)[MT][2],
                                                 float (&acc)[MT][DT][4], float (&lse)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      bool empty = l[mt][h] == 0.f;  // (a NaN l, from a NaN score, is no empty row: o and lse NaN)
      inv[h] = empty ? 0.f : 1.f / l[mt][h];
      lse[mt][h] = empty ? -INFINITY : log2_norm(m[mt][h], l[mt][h]) * rule::kLn2;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      acc[mt][dt][0] *= inv[0];
      acc[mt][dt][1] *= inv[0];
      acc[mt][dt][2] *= inv[1];
      acc[mt][dt][3] *= inv[1];
    }
  }
}

}  // namespace cuda
}  // namespace mala

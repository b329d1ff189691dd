// The MALA rule, written once for the CPU implementation and every CUDA kernel.
// See docs/spec.md for the definition these functions implement.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define MALA_HD __host__ __device__ __forceinline__
#else
#define MALA_HD inline
#endif

namespace mala {
namespace rule {

// tau = 0 is exact dense attention: nothing can be skipped, and every kernel runs its dense instance
// (compiled without the test).  The one spelling of "tau = 0" in the code: dense / kDense.
MALA_HD bool dense(float tau) { return !(tau > 0.f); }
// log2(tau), the kernels' base-2 form of tau (-inf for tau = 0).
inline float log2_tau(float tau) { return tau > 0.f ? log2f(tau) : -INFINITY; }
// The kernels keep m, lse and thresholds in base 2; the API's lse is a natural log.  The one
// spelling of each conversion factor.
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): natural log -> base 2
constexpr float kLn2 = 0.69314718055994531f;   // ln(2): base 2 -> natural log
// softmax_scale * log2(e): the factor that puts raw scores q.k in the kernels' base-2 units.
MALA_HD float scale_log2(float softmax_scale) { return softmax_scale * kLog2e; }

// Keys visible to query row `row` (0-based): bottom-right causal alignment, so row q sees keys
// k <= q + (seqlen_k - seqlen_q).  Clamped to [0, seqlen_k].  Non-causal rows see every key.
MALA_HD int visible_keys(int row, int seqlen_q, int seqlen_k, bool causal) {
  if (!causal) return seqlen_k;
  int L = row + seqlen_k - seqlen_q + 1;
  return L < 0 ? 0 : (L > seqlen_k ? seqlen_k : L);
}

// The L_q that row `row` (0-based in the call) is tested with, when it sees L keys in the call: L,
// or when the call is one split of a longer causal sequence whose row 0 sits at position rows_before
// (>= 0; context parallelism: ForwardArgs::rows_before) the row's whole length rows_before + row + 1.
// A row that sees no key keeps 0 (it never constrains a tile).
MALA_HD int threshold_length(int L, int row, int rows_before) {
  return rows_before >= 0 && L > 0 ? rows_before + row + 1 : L;
}

// log(tau / L) in the given log base (log_tau = log_b(tau), log_L = log_b(L)).  tau = 0 gives -inf:
// nothing is ever skipped.  Only meaningful for L > 0.
MALA_HD float log_threshold(float log_tau, float log_L) { return log_tau - log_L; }

// The tile test for one row.  True when this row lets the tile be skipped.
//   tile_max : the row's largest score over its legal keys in the tile (-inf when it has none:
//              such a row does not constrain the tile)
//   log_norm : log of the normalizer tested against: m + log(l) of the mass retained so far
//              (online, forward/decode; -inf before anything is retained, so the first legal
//              tile is always kept) or the saved lse (offline, backward)
//   log_thr  : log(tau / L_q)
// All three must be in the same log base (natural on the CPU, base 2 in the kernels).
// A tile is skipped iff every row of the query tile allows it.
// The comparison itself, for callers that guarantee log_norm finite and log_thr > -inf.  Then
// tile_max = -inf gives -inf < log_thr: no special case is needed.  (A NaN log_norm, the saved lse
// of a NaN row in the backward, breaks that: -inf - NaN < log_thr is false, so a row without legal
// keys in the tile would block it; the backward therefore tests with row_allows_skip.)
MALA_HD bool row_allows_skip_finite_norm(float tile_max, float log_norm, float log_thr) {
  return tile_max - log_norm < log_thr;
}

// The larger of a and b, NaN when either is NaN.  A row max must propagate a NaN score (std::max and
// fmaxf drop it): a NaN row would otherwise look like a row without legal keys (-inf), its tile be
// skipped, and the output become a finite zero.  A NaN tile_max fails every test (NaN < x is false),
// so the tile is retained and the NaN reaches o and lse, as in dense attention.
// The one definition for every kernel's row maxima too (scores, warp and CTA reductions, the
// running m, the split-KV combine): on the device one max.NaN.f32 (sm_80+), as cheap as fmaxf.
template <class T>
MALA_HD T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}
MALA_HD float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a > b || a != a) ? a : b;
#endif
}

MALA_HD bool row_allows_skip(float tile_max, float log_norm, float log_thr) {
  if (tile_max == -INFINITY) return true;
  return row_allows_skip_finite_norm(tile_max, log_norm, log_thr);
}

// The test solved for the raw score, for kernels that compare each lane's raw q.k row max against a
// bound kept per row and recomputed only when the normaliser changes (the 128-key forward):
// with tile_max = raw / inv_scale (inv_scale > 0), row_allows_skip(tile_max, log_norm, log_thr) holds
// iff row_allows_skip_raw(raw, skip_bound_raw(log_norm, log_thr, inv_scale)), up to the rounding of
// the rearrangement (margins near 1e-6, far inside the 1e-3 flips docs/spec.md allows).  The special
// rows need no branch: nothing retained yet (log_norm = -inf) gives the bound -inf, which any legal
// (finite) score exceeds and a row without legal keys in the tile (raw = -inf) does not; a row with
// no legal key at all (log_thr = +inf, raw always -inf) gets +inf or NaN, which raw = -inf passes.
MALA_HD float skip_bound_raw(float log_norm, float log_thr, float inv_scale) {
  return log_norm * inv_scale + log_thr * inv_scale;
}
// NaN: a NaN raw_max (a NaN score) blocks, and so does any legal score (raw_max > -inf) against a
// NaN bound (a row whose m, l or lse is NaN), as row_allows_skip does; raw_max = -inf (no legal key
// in the tile) allows whatever the bound, NaN included (the row without any legal key above).
MALA_HD bool row_allows_skip_raw(float raw_max, float bound) { return raw_max == -INFINITY || raw_max <= bound; }

// Margin of the test, (tile_max - log_norm) - log_thr: negative allows skipping.  Used by tests to
// recognise rounding flips (|margin| below ~1e-3).
MALA_HD float row_margin(float tile_max, float log_norm, float log_thr) {
  return (tile_max - log_norm) - log_thr;
}

// Split-KV partition of a sequence's key tiles [0, n_tiles): split s owns
// [s * per, min((s + 1) * per, n_tiles)) with per = ceil(n_tiles / num_splits).  Splits past the
// end own nothing.  Each split walks its tiles from the last down.
MALA_HD void split_tiles(int n_tiles, int num_splits, int split, int* begin, int* end) {
  int per = (n_tiles + num_splits - 1) / num_splits;
  int b = split * per;
  int e = b + per;
  *begin = b < n_tiles ? b : n_tiles;
  *end = e < n_tiles ? e : n_tiles;
}

MALA_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- seeded split-KV (docs/spec.md, "Split rules") ------------------------------------------------
// The anchor tiles of a query tile: key tile 0 and the newest legal key tile of each of its rows
// (the tile holding key L_q - 1; rows with L_q = 0 have none).  The rows' newest tiles form the
// contiguous range [newest_tile(min L_q > 0), newest_tile(max L_q)], one tile when all rows share L_q
// (a single token, packed GQA or not).  With num_splits > 1 the split that owns an anchor tile retains
// it untested; every split adds the exact mass of the anchor tiles it does not own, over each row's
// legal keys, to the denominator of its test (nothing else: m, l, the accumulator and the combine are
// the usual ones).  num_splits = 1 is the forward rule: no seed, nothing forced.
MALA_HD int newest_tile(int L, int block_k) { return (L - 1) / block_k; }  // L > 0
// The same for a call whose key tile 0 may not be the sequence's (one KV shard of context
// parallelism: ForwardArgs::owns_tile0); newest_lo > newest_hi when it holds no row's newest tile.
MALA_HD bool is_held_anchor_tile(int j, bool holds_tile0, int newest_lo, int newest_hi) {
  return (j == 0 && holds_tile0) || (j >= newest_lo && j <= newest_hi);
}
MALA_HD bool is_anchor_tile(int j, int newest_lo, int newest_hi) {
  return is_held_anchor_tile(j, true, newest_lo, newest_hi);
}
// log(exp(a) + exp(b)), -inf + -inf = -inf.  The seeded test's log_norm is
// log_add_exp(log Z_anchor, m + log(l)) = log(Z_anchor + exp(m) l), passed to row_allows_skip.
MALA_HD float log_add_exp(float a, float b) {
  const float hi = a > b ? a : b, lo = a > b ? b : a;
  if (hi == -INFINITY) return -INFINITY;
  return hi + log1pf(expf(lo - hi));
}

}  // namespace rule
}  // namespace mala

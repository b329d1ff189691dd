// Fidelity and work statistics over CPU arrays (docs/spec.md, "Work accounting").
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/rule.h"
#include "mala/mala.h"

namespace mala {

namespace {
// Mean, 95th percentile (nearest rank: the ceil(0.95 n)-th smallest) and max of the values.
Distribution summarize(std::vector<double>& v) {
  Distribution d;
  d.count = static_cast<int64_t>(v.size());
  if (v.empty()) return d;
  double sum = 0;
  for (double x : v) sum += x;
  d.mean = sum / static_cast<double>(v.size());
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(0.95 * static_cast<double>(v.size())));
  d.p95 = v[std::max<size_t>(rank, 1) - 1];
  d.max = v.back();
  return d;
}
}  // namespace

Distribution slot_stats(const int32_t* slots, int64_t batch, int64_t heads_q, int64_t seqlen_q,
                        int64_t seqlen_k, bool causal) {
  std::vector<double> v;
  if (!slots || batch <= 0 || heads_q <= 0 || seqlen_q <= 0) return Distribution{};
  v.reserve(static_cast<size_t>(batch * heads_q * seqlen_q));
  for (int64_t bh = 0; bh < batch * heads_q; ++bh)
    for (int64_t r = 0; r < seqlen_q; ++r) {
      if (rule::visible_keys(static_cast<int>(r), static_cast<int>(seqlen_q), static_cast<int>(seqlen_k), causal) == 0)
        continue;
      v.push_back(slots[bh * seqlen_q + r]);
    }
  return summarize(v);
}

// Retained / (retained + skipped); 0 when the mask holds no legal tile.
double retained_fraction(const uint8_t* tile_mask, int64_t n) {
  int64_t retained = 0, skipped = 0;
  for (int64_t i = 0; tile_mask && i < n; ++i) {
    retained += tile_mask[i] == kTileRetained;
    skipped += tile_mask[i] == kTileSkipped;
  }
  return retained + skipped == 0 ? 0.0 : static_cast<double>(retained) / static_cast<double>(retained + skipped);
}

// 1 - exp(lse - lse_dense) per row (may be slightly negative from rounding; reported as is).
Distribution omitted_mass(const float* lse, const float* lse_dense, int64_t n) {
  std::vector<double> v;
  for (int64_t i = 0; lse && lse_dense && i < n; ++i) {
    if (lse_dense[i] == -INFINITY) continue;
    v.push_back(-std::expm1(static_cast<double>(lse[i]) - static_cast<double>(lse_dense[i])));
  }
  return summarize(v);
}

// ||x - ref|| / ||ref||; when ref is all zero, the absolute ||x - ref||.
double relative_l2(const float* x, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(x[i]) - ref[i];
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace mala

// The fidelity and work statistics on hand-computed inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "mala/mala.h"

namespace {

TEST(Analysis, SlotStatsSkipRowsWithoutKeys) {
  // batch 1, 2 heads, seqlen_q 4, seqlen_k 2, causal: rows 0 and 1 see no key (L = r - 1).
  const std::vector<int32_t> slots = {0, 0, 10, 30, 0, 0, 20, 40};
  const mala::Distribution d = mala::slot_stats(slots.data(), 1, 2, 4, 2, true);
  EXPECT_EQ(d.count, 4);
  EXPECT_DOUBLE_EQ(d.mean, 25.0);
  EXPECT_DOUBLE_EQ(d.max, 40.0);
  EXPECT_DOUBLE_EQ(d.p95, 40.0);  // nearest rank: ceil(0.95 * 4) = 4th smallest
  const mala::Distribution nc = mala::slot_stats(slots.data(), 1, 2, 4, 2, false);
  EXPECT_EQ(nc.count, 8);
  EXPECT_DOUBLE_EQ(nc.mean, 12.5);
}

TEST(Analysis, P95IsNearestRank) {
  std::vector<int32_t> slots(100);
  for (int i = 0; i < 100; ++i) slots[i] = 100 - i;  // 1..100
  const mala::Distribution d = mala::slot_stats(slots.data(), 1, 1, 100, 100, false);
  EXPECT_DOUBLE_EQ(d.p95, 95.0);
  EXPECT_DOUBLE_EQ(d.mean, 50.5);
}

TEST(Analysis, RetainedFractionIgnoresIllegalTiles) {
  const std::vector<uint8_t> mask = {mala::kTileIllegal, mala::kTileRetained, mala::kTileSkipped,
                                     mala::kTileSkipped, mala::kTileRetained, mala::kTileSkipped, mala::kTileIllegal};
  EXPECT_DOUBLE_EQ(mala::retained_fraction(mask.data(), (int64_t)mask.size()), 2.0 / 5.0);
  const std::vector<uint8_t> none = {mala::kTileIllegal};
  EXPECT_DOUBLE_EQ(mala::retained_fraction(none.data(), 1), 0.0);
}

TEST(Analysis, OmittedMassSkipsEmptyRows) {
  const std::vector<float> lse = {1.f, -INFINITY, std::log(0.5f), 2.f};
  const std::vector<float> dense = {1.f, -INFINITY, 0.f, 2.f + std::log(4.f)};
  const mala::Distribution d = mala::omitted_mass(lse.data(), dense.data(), 4);
  EXPECT_EQ(d.count, 3);
  EXPECT_NEAR(d.max, 0.75, 1e-6);
  EXPECT_NEAR(d.mean, (0.0 + 0.5 + 0.75) / 3, 1e-6);
}

TEST(Analysis, RelativeL2) {
  const std::vector<float> ref = {3.f, 4.f}, x = {3.f, 5.f}, zero = {0.f, 0.f};
  EXPECT_DOUBLE_EQ(mala::relative_l2(x.data(), ref.data(), 2), 0.2);
  EXPECT_DOUBLE_EQ(mala::relative_l2(ref.data(), ref.data(), 2), 0.0);
  EXPECT_DOUBLE_EQ(mala::relative_l2(x.data(), zero.data(), 2), std::sqrt(34.0));  // absolute when ref = 0
}

}  // namespace

// The backward's launch order (src/cuda/bwd/cta_order.h): every (key tile, rest) exactly once, key
// tile 0 of every rest first, then each rest's other key tiles ascending and together, so that a
// window of resident CTAs spans at most two rests (the property the dQ rows' L2 reuse rests on).
#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

#include "cuda/bwd/cta_order.h"

namespace {

using mala::cuda::bwd_cta_slot;

TEST(BwdCtaOrder, EveryTileOnceSinkFirstThenRestByRest) {
  for (int n_k : {1, 2, 3, 64, 256, 1024})
    for (int per_j : {1, 2, 6, 8, 12}) {
      std::set<std::pair<int, int>> seen;
      int last_rest = -1, last_j = 0;
      for (int x = 0; x < n_k * per_j; ++x) {
        const auto s = bwd_cta_slot(x, n_k, per_j);
        ASSERT_GE(s.j, 0);
        ASSERT_LT(s.j, n_k);
        ASSERT_GE(s.rest, 0);
        ASSERT_LT(s.rest, per_j);
        ASSERT_TRUE(seen.insert({s.j, s.rest}).second) << "n_k " << n_k << " per_j " << per_j << " x " << x;
        if (x < per_j) {
          EXPECT_EQ(s.j, 0);
          EXPECT_EQ(s.rest, x);
        } else {
          EXPECT_GE(s.j, 1);
          if (s.rest == last_rest) {
            EXPECT_EQ(s.j, last_j + 1) << "a rest's key tiles ascend without gaps";
          } else {
            EXPECT_EQ(s.rest, last_rest + 1);
            EXPECT_EQ(s.j, 1);
          }
          last_rest = s.rest;
          last_j = s.j;
        }
      }
      EXPECT_EQ(static_cast<int>(seen.size()), n_k * per_j);
    }
}

TEST(BwdCtaOrder, ResidentWindowSpansAtMostTwoRests) {
  // 132 resident CTAs (one per SM on an H100), 32K and 128K key tiles, 6 and 8 rests: past the
  // first per_j CTAs, any window of 132 neighbours covers at most two rests.
  const int window = 132;
  for (int n_k : {256, 1024})
    for (int per_j : {6, 8}) {
      const int total = n_k * per_j;
      for (int x0 = per_j; x0 + window <= total; ++x0) {
        std::set<int> rests;
        for (int x = x0; x < x0 + window; ++x) rests.insert(bwd_cta_slot(x, n_k, per_j).rest);
        ASSERT_LE(rests.size(), 2u) << "n_k " << n_k << " per_j " << per_j << " from " << x0;
      }
    }
}

TEST(BwdCtaOrder, MmaSyncKernelKeyTilesSlowest) {
  for (int per_j : {1, 6})
    for (int x = 0; x < 40 * per_j; ++x) {
      const auto s = mala::cuda::bwd_cta_slot_key_slowest(x, per_j);
      EXPECT_EQ(s.j, x / per_j);
      EXPECT_EQ(s.rest, x % per_j);
    }
}

}  // namespace

#include "core/call_cost.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace attention {
namespace {

// Visible (query, key) pairs counted one by one from the mask's definition
// (attention_problem.h).
int64_t CountVisible(int64_t queries, int64_t keys, const MaskSpec& mask) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t p = mask.query_start + i;
    for (int64_t j = 0; j < keys; ++j) {
      const bool causal_ok = !mask.causal || j <= p;
      const bool window_ok = mask.window == 0 || p - j < mask.window ||
                             j < mask.num_sink_tokens;
      if (causal_ok && window_ok) ++pairs;
    }
  }
  return pairs;
}

TEST(CallCostTest, ExactWithoutAWindowAndAnUpperBoundWithOne) {
  for (int64_t start : {0, 1, 7, 40}) {
    for (int64_t queries : {1, 2, 9, 33}) {
      const int64_t keys = start + queries;
      MaskSpec causal{.causal = true, .query_start = start};
      // Widths below 16 count as 16 (the kernels' block of values).
      EXPECT_DOUBLE_EQ(AttentionFlops(queries, 3, 8, 4, causal, keys),
                       2.0 * 32 * 3 * CountVisible(queries, keys, causal));
      EXPECT_DOUBLE_EQ(AttentionFlops(queries, 3, 128, 48, causal, keys),
                       2.0 * 176 * 3 * CountVisible(queries, keys, causal));
      for (int32_t window : {1, 5, 16}) {
        for (int32_t sinks : {0, 2}) {
          MaskSpec mask{.causal = true,
                        .window = window,
                        .num_sink_tokens = sinks,
                        .query_start = start};
          const double flops = AttentionFlops(queries, 1, 1, 1, mask, keys);
          const int64_t visible = CountVisible(queries, keys, mask);
          EXPECT_GE(flops, 64.0 * visible);
          EXPECT_LE(flops, 64.0 * queries * (window + sinks));
        }
      }
    }
  }
  MaskSpec full{.causal = false};
  EXPECT_DOUBLE_EQ(AttentionFlops(5, 2, 3, 4, full, 11), 2.0 * 32 * 2 * 5 * 11);
  EXPECT_EQ(AttentionFlops(0, 2, 3, 4, full, 11), 0);
}

// Every row of a causal call whose positions lie past all its keys sees all
// of them, at any query_start: near 2^63 a double steps by 1024, and the
// row count taken as a difference of positions came out as 1 there.
TEST(CallCostTest, RowsFarFromTheStartAreEachCounted) {
  for (const int64_t start : {int64_t{40}, int64_t{1} << 40, int64_t{1} << 62,
                              std::numeric_limits<int64_t>::max() - 600}) {
    for (const int64_t queries : {1, 2, 100, 512}) {
      const MaskSpec causal{.causal = true, .query_start = start};
      EXPECT_DOUBLE_EQ(AttentionFlops(queries, 1, 1, 1, causal, 30),
                       64.0 * queries * 30)
          << start << " " << queries;
    }
  }
  // Rows reaching the key count partway: min(p + 1, keys) row by row.
  const MaskSpec causal{.causal = true, .query_start = 5};
  EXPECT_DOUBLE_EQ(AttentionFlops(10, 1, 1, 1, causal, 9),
                   64.0 * CountVisible(10, 9, causal));
}

TEST(CallCostTest, HugeDimensionsDoNotOverflow) {
  MaskSpec full{.causal = false};
  const double flops =
      AttentionFlops(int64_t{1} << 40, 1 << 20, 1 << 20, 1 << 20, full,
                     int64_t{1} << 40);
  EXPECT_GT(flops, 1e30);
}

// Top-k: index scoring over every visible pair plus attention over at most
// topk keys per query.
TEST(CallCostTest, TopKCountsIndexScoringAndAtMostTopKKeys) {
  for (int64_t start : {0, 5, 100}) {
    for (int64_t queries : {1, 8, 40}) {
      const int64_t keys = start + queries;
      const MaskSpec causal{.causal = true, .query_start = start};
      int64_t attended = 0;
      for (int64_t i = 0; i < queries; ++i) {
        attended += std::min<int64_t>(start + i + 1, 16);
      }
      const int64_t visible = CountVisible(queries, keys, causal);
      EXPECT_DOUBLE_EQ(
          TopKAttentionFlops(queries, 4, 8, 6, 2, 5, 16, causal, keys),
          (2.0 * 2 * (16 + 1) + 16) * visible + 2.0 * (16 + 16) * 4 * attended);
    }
  }
  // k >= visible: the attention part is the dense cost.
  const MaskSpec causal{.causal = true};
  EXPECT_DOUBLE_EQ(
      TopKAttentionFlops(10, 4, 8, 6, 1, 1, 1000, causal, 10),
      AttentionFlops(10, 4, 8, 6, causal, 10) + (2.0 * 17 + 16) * 55);
  // Wide index keys count their width.
  EXPECT_DOUBLE_EQ(TopKAttentionFlops(1, 4, 8, 6, 2, 128, 1000, causal, 1),
                   AttentionFlops(1, 4, 8, 6, causal, 1) + 2.0 * 2 * 129 + 16);
}

}  // namespace
}  // namespace attention

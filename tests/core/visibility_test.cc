// The visibility rule (core/visibility.h): its predicate against the rule
// as attention_problem.h states it, and its interval form against the
// predicate, exhaustively over small masks.
#include "core/visibility.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace attention {
namespace {

// attention_problem.h, word for word.
bool Stated(bool causal, int window, int sinks, int64_t length, int64_t p,
            int64_t j) {
  return j < length && (!causal || j <= p) &&
         (window == 0 || p - j < window || j < sinks);
}

TEST(VisibilityTest, PredicateAndIntervalsAgreeWithTheStatedRule) {
  for (bool causal : {false, true}) {
    for (int window : {0, 1, 3, 8}) {
      for (int sinks : {0, 1, 4}) {
        if (sinks > 0 && window == 0) continue;  // invalid spec
        for (int64_t length : {0, 1, 5, 13}) {
          for (int64_t p = 0; p < 16; ++p) {
            const VisibleKeys keys =
                VisibleKeysOf(causal, window, sinks, length, p);
            EXPECT_LE(keys.sinks, keys.hi + 1);
            for (int64_t j = 0; j < 16; ++j) {
              const bool stated = Stated(causal, window, sinks, length, p, j);
              EXPECT_EQ(KeyIsVisible(causal, window, sinks, length, p, j),
                        stated)
                  << causal << " " << window << " " << sinks << " " << length
                  << " p=" << p << " j=" << j;
              const bool in_intervals =
                  j <= keys.hi && (j >= keys.lo || j < keys.sinks);
              EXPECT_EQ(in_intervals, stated)
                  << causal << " " << window << " " << sinks << " " << length
                  << " p=" << p << " j=" << j;
            }
          }
        }
      }
    }
  }
}

TEST(VisibilityTest, FirstReachablePositionIsTheLaterQueriesWindowStart) {
  EXPECT_EQ(FirstReachablePosition(0, 100), 0);
  EXPECT_EQ(FirstReachablePosition(8, 5), 0);
  EXPECT_EQ(FirstReachablePosition(8, 100), 93);
  // No query at a position >= length sees a key before it (sinks aside).
  for (int64_t length = 0; length < 40; ++length) {
    const int64_t first = FirstReachablePosition(8, length);
    for (int64_t p = length; p < length + 5; ++p) {
      for (int64_t j = 0; j < first; ++j) {
        EXPECT_FALSE(KeyIsVisible(true, 8, 0, p + 1, p, j));
      }
    }
  }
}

}  // namespace
}  // namespace attention

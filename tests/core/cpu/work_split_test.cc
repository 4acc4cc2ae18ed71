#include "core/cpu/work_split.h"

#include <cstdint>

#include "core/attention_problem.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

// Pieces a unit of `chunks` chunks runs as.
int64_t Pieces(int64_t chunks, int64_t chunks_per_piece) {
  return (chunks + chunks_per_piece - 1) / chunks_per_piece;
}

TEST(WorkSplitTest, OneThreadNeverSplits) {
  EXPECT_EQ(ChunksPerPiece(1, 64, 1), kNoSplit);
  EXPECT_EQ(ChunksPerPiece(8, 512, 0), kNoSplit);
}

TEST(WorkSplitTest, ManyUnitsRunWhole) {
  // A decode batch of 16 sessions x 8 KV heads keeps 16 threads busy.
  EXPECT_EQ(ChunksPerPiece(128, 512, 16), kNoSplit);
  // Prefill of 2048 rows: 128 row blocks x 16 KV heads.
  EXPECT_EQ(ChunksPerPiece(2048, 2048 * 4, 2), kNoSplit);
}

// Parallel items of a call with `units` units of `chunks` chunks each.
int64_t Items(int64_t units, int64_t chunks, int threads) {
  const int64_t per_piece = ChunksPerPiece(units, units * chunks, threads);
  return per_piece == kNoSplit ? units : units * Pieces(chunks, per_piece);
}

TEST(WorkSplitTest, LoneLongDecodeUsesEveryThread) {
  // One decode row, 8 KV heads: 8 units of T / kKeysPerSplit chunks.
  for (int64_t length : {8192, 32768}) {
    const int64_t chunks = length / kKeysPerSplit;
    for (int threads : {2, 8, 16, 64}) {
      EXPECT_GE(Items(8, chunks, threads), threads)
          << "T=" << length << ", " << threads << " threads";
    }
  }
  // On 16 threads the 8 heads are split at all.
  EXPECT_NE(ChunksPerPiece(8, 8 * 64, 16), kNoSplit);
}

TEST(WorkSplitTest, NothingToSplit) {
  EXPECT_EQ(ChunksPerPiece(2, 0, 8), kNoSplit);
}

}  // namespace
}  // namespace attention

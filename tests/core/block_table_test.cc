#include "core/block_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace attention {
namespace {

// Logical entries of `table`, kNoBlock where dropped.
std::vector<BlockId> Logical(const BlockTable& table) {
  std::vector<BlockId> entries;
  for (int64_t b = 0; b < table.size(); ++b) entries.push_back(table.at(b));
  return entries;
}

BlockTable Of(const std::vector<BlockId>& entries) {
  BlockTable table;
  for (BlockId id : entries) table.push_back(id);
  return table;
}

constexpr BlockId X = kNoBlock;

TEST(BlockTableTest, CompactFoldsTheFirstDroppedRunAndThenExtendsIt) {
  BlockTable table = Of({7, X, X, 3, 4});
  table.Compact();
  EXPECT_EQ(table.size(), 5);
  EXPECT_EQ(table.stored(), (std::vector<BlockId>{7, 3, 4}));
  EXPECT_EQ(Logical(table), (std::vector<BlockId>{7, X, X, 3, 4}));
  EXPECT_EQ(table.SkipGap(0), 0);
  EXPECT_EQ(table.SkipGap(1), 3);
  EXPECT_EQ(table.SkipGap(2), 3);
  EXPECT_EQ(table.SkipGap(4), 4);
  table.mutable_at(3) = X;  // the block after the run is dropped too
  table.push_back(9);
  table.Compact();
  EXPECT_EQ(table.stored(), (std::vector<BlockId>{7, 4, 9}));
  EXPECT_EQ(Logical(table), (std::vector<BlockId>{7, X, X, X, 4, 9}));
  EXPECT_EQ(table.bytes(), 3 * kBlockTableEntryBytes);
  table.mutable_at(5) = 8;
  EXPECT_EQ(table.at(5), 8);
}

TEST(BlockTableTest, TruncateAfterInsideAndBeforeTheRun) {
  const auto dropped_middle = [] {
    BlockTable table = Of({1, X, X, X, 5, 6});
    table.Compact();
    return table;
  };
  {
    BlockTable table = dropped_middle();
    std::vector<BlockId> released;
    table.Truncate(5, &released);
    EXPECT_EQ(released, (std::vector<BlockId>{6}));
    EXPECT_EQ(Logical(table), (std::vector<BlockId>{1, X, X, X, 5}));
  }
  {
    BlockTable table = dropped_middle();
    std::vector<BlockId> released;
    table.Truncate(3, &released);
    EXPECT_EQ(released, (std::vector<BlockId>{5, 6}));
    EXPECT_EQ(Logical(table), (std::vector<BlockId>{1, X, X}));
    table.push_back(9);
    EXPECT_EQ(Logical(table), (std::vector<BlockId>{1, X, X, 9}));
  }
  {
    BlockTable table = dropped_middle();
    std::vector<BlockId> released;
    table.Truncate(1, &released);
    EXPECT_EQ(released, (std::vector<BlockId>{5, 6}));
    EXPECT_EQ(Logical(table), (std::vector<BlockId>{1}));
    table.Truncate(0, &released);
    EXPECT_EQ(table.size(), 0);
    table.push_back(2);
    EXPECT_EQ(Logical(table), (std::vector<BlockId>{2}));
  }
}

TEST(BlockTableTest, AllDroppedStoresNothing) {
  BlockTable table = Of({X, X, X});
  table.Compact();
  EXPECT_EQ(table.size(), 3);
  EXPECT_TRUE(table.stored().empty());
  table.push_back(4);
  EXPECT_EQ(Logical(table), (std::vector<BlockId>{X, X, X, 4}));
  table.Clear();
  EXPECT_EQ(table.size(), 0);
}

}  // namespace
}  // namespace attention

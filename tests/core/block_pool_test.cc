#include "core/block_pool.h"

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "core/cpu/cpu_backend.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

class BlockPoolTest : public ::testing::Test {
 protected:
  CpuBackend backend_{1};
};

TEST_F(BlockPoolTest, CapacityIsWholeBlocks) {
  auto pool = BlockPool::Create(&backend_, 10 * 1024 + 100, 1024);
  ASSERT_TRUE(pool.ok()) << pool.status();
  BlockPoolStats stats = (*pool)->stats();
  EXPECT_EQ(stats.blocks_total, 10);
  EXPECT_EQ(stats.capacity_bytes, 10 * 1024);
  EXPECT_EQ(stats.blocks_used, 0);
  EXPECT_EQ(stats.used_bytes, 0);
}

TEST_F(BlockPoolTest, RejectsBadGeometry) {
  EXPECT_EQ(BlockPool::Create(&backend_, 1 << 20, 1000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BlockPool::Create(&backend_, 512, 1024).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(BlockPoolTest, AllocateIsAllOrNothing) {
  auto pool = *BlockPool::Create(&backend_, 4 * 1024, 1024);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->Allocate(3, &ids).ok());
  EXPECT_EQ(ids.size(), 3u);
  absl::Status status = pool->Allocate(2, &ids);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("--kv_cache_bytes"), absl::string_view::npos)
      << "the message tells the operator what to change";
  EXPECT_EQ(ids.size(), 3u);
  EXPECT_EQ(pool->stats().blocks_used, 3);
  ASSERT_TRUE(pool->Allocate(1, &ids).ok());
  EXPECT_EQ(pool->stats().blocks_used, 4);
}

TEST_F(BlockPoolTest, BlocksAreDistinctAndDisjoint) {
  auto pool = *BlockPool::Create(&backend_, 8 * 1024, 1024);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->Allocate(8, &ids).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (size_t j = i + 1; j < ids.size(); ++j) {
      EXPECT_NE(ids[i], ids[j]);
      const std::ptrdiff_t gap = pool->data(ids[i]) - pool->data(ids[j]);
      EXPECT_GE(std::abs(gap), 1024);
    }
  }
}

TEST_F(BlockPoolTest, ReferenceCountingFreesOnLastUnref) {
  auto pool = *BlockPool::Create(&backend_, 2 * 1024, 1024);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->Allocate(1, &ids).ok());
  const BlockId id = ids[0];
  pool->Ref(id);
  EXPECT_EQ(pool->RefCount(id), 2);
  pool->Unref(id);
  EXPECT_EQ(pool->RefCount(id), 1);
  EXPECT_EQ(pool->stats().blocks_used, 1);
  pool->UnrefAll({id, kNoBlock});
  EXPECT_EQ(pool->RefCount(id), 0);
  EXPECT_EQ(pool->stats().blocks_used, 0);
  // Freed blocks can be handed out again.
  ids.clear();
  ASSERT_TRUE(pool->Allocate(2, &ids).ok());
}

TEST_F(BlockPoolTest, CopyBlockCopiesBytes) {
  auto pool = *BlockPool::Create(&backend_, 2 * 1024, 1024);
  std::vector<BlockId> ids;
  ASSERT_TRUE(pool->Allocate(2, &ids).ok());
  for (int i = 0; i < 1024; ++i) {
    pool->data(ids[0])[i] = static_cast<std::byte>(i * 7);
  }
  ASSERT_TRUE(pool->CopyBlock(ids[0], ids[1]).ok());
  for (int i = 0; i < 1024; ++i) {
    ASSERT_EQ(pool->data(ids[1])[i], static_cast<std::byte>(i * 7));
  }
}

}  // namespace
}  // namespace attention

#include "core/layer_kv_cache.h"

#include <memory>
#include <random>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/session_snapshot.h"
#include "gtest/gtest.h"
#include "tests/core/test_tensors.h"

namespace attention {
namespace {

using testing::HostTensor;
using testing::RandomTensor;

constexpr int kHeads = 2;
constexpr int kDim = 4;

class LayerKvCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_.dtype = DType::kFloat32;
    layout_.num_kv_heads = kHeads;
    layout_.head_dim = kDim;
    layout_.value_dim = kDim;
    layout_.tokens_per_block = 4;
    // 4 tokens * 2 heads * 8 floats * 4 bytes = 256 bytes per block.
    pool_ = *BlockPool::Create(&backend_, 64 * 256, 256);
  }

  // Appends `count` random tokens and returns their K tensor.
  HostTensor Append(LayerKvCache& cache, int64_t count) {
    HostTensor k = RandomTensor({count, kHeads, kDim}, rng_);
    HostTensor v = RandomTensor({count, kHeads, kDim}, rng_);
    auto pending = cache.PrepareAppend(count);
    EXPECT_TRUE(pending.ok()) << pending.status();
    KvWrite write = pending->write_target();
    write.k = k.view();
    write.v = v.view();
    EXPECT_TRUE(backend_.WriteKv(write).ok());
    cache.Commit(*std::move(pending), /*reservation=*/nullptr);
    return k;
  }

  float KeyAt(const LayerKvCache& cache, int64_t pos, int head, int d) {
    std::vector<const std::byte*> ks, vs;
    KvView view = cache.view(&ks, &vs);
    float x;
    std::memcpy(&x, view.key(pos, head) + d * 4, 4);
    return x;
  }

  std::mt19937 rng_{7};
  CpuBackend backend_{1};
  KvBlockLayout layout_;
  std::unique_ptr<BlockPool> pool_;
};

TEST_F(LayerKvCacheTest, AppendStoresKeysAtTheirPositions) {
  LayerKvCache cache(pool_.get(), layout_, LayerSpec{});
  HostTensor first = Append(cache, 3);
  HostTensor second = Append(cache, 6);
  EXPECT_EQ(cache.length(), 9);
  EXPECT_EQ(cache.referenced_blocks(), 3);
  for (int h = 0; h < kHeads; ++h) {
    for (int d = 0; d < kDim; ++d) {
      EXPECT_EQ(KeyAt(cache, 1, h, d),
                first.values[(1 * kHeads + h) * kDim + d]);
      EXPECT_EQ(KeyAt(cache, 7, h, d),
                second.values[(4 * kHeads + h) * kDim + d]);
    }
  }
}

TEST_F(LayerKvCacheTest, AbandonedAppendReleasesItsBlocks) {
  LayerKvCache cache(pool_.get(), layout_, LayerSpec{});
  Append(cache, 5);
  const int64_t used = pool_->stats().blocks_used;
  {
    auto pending = cache.PrepareAppend(20);
    ASSERT_TRUE(pending.ok());
    EXPECT_GT(pool_->stats().blocks_used, used);
  }
  EXPECT_EQ(pool_->stats().blocks_used, used);
  EXPECT_EQ(cache.length(), 5);
}

TEST_F(LayerKvCacheTest, PoolExhaustionChangesNothing) {
  LayerKvCache cache(pool_.get(), layout_, LayerSpec{});
  Append(cache, 10);
  const int64_t used = pool_->stats().blocks_used;
  auto pending = cache.PrepareAppend(64 * 4);
  EXPECT_EQ(pending.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool_->stats().blocks_used, used);
  EXPECT_EQ(cache.length(), 10);
}

TEST_F(LayerKvCacheTest, ForkSharesThenCopiesOnWrite) {
  LayerKvCache parent(pool_.get(), layout_, LayerSpec{});
  Append(parent, 6);  // blocks: [0..3] full, [4..5] partial
  const float before = KeyAt(parent, 5, 1, 2);
  LayerKvCache child = parent.Fork();
  EXPECT_EQ(pool_->stats().blocks_used, 2) << "a fork shares every block";
  HostTensor child_keys = Append(child, 1);  // writes into the shared tail
  EXPECT_EQ(pool_->stats().blocks_used, 3) << "the shared tail was copied";
  HostTensor parent_keys = Append(parent, 1);
  EXPECT_EQ(KeyAt(parent, 5, 1, 2), before);
  EXPECT_EQ(KeyAt(child, 5, 1, 2), before);
  EXPECT_EQ(KeyAt(child, 6, 0, 0), child_keys.values[0]);
  EXPECT_EQ(KeyAt(parent, 6, 0, 0), parent_keys.values[0]);
}

TEST_F(LayerKvCacheTest, WindowLayerKeepsWindowSinksAndSlack) {
  LayerSpec mask;
  mask.window = 8;
  mask.num_sink_tokens = 2;
  LayerKvCache cache(pool_.get(), layout_, mask);
  for (int i = 0; i < 10; ++i) Append(cache, 5);  // 50 tokens
  // Needed: sinks (block 0) and keys >= 50 - 8 + 1 - 4 = 39 (blocks 9..12).
  EXPECT_EQ(cache.referenced_blocks(), 1 + 4);
  EXPECT_EQ(pool_->stats().blocks_used, 5);
}

TEST_F(LayerKvCacheTest, TruncateRespectsDroppedWindowKeys) {
  LayerSpec mask;
  mask.window = 8;
  LayerKvCache cache(pool_.get(), layout_, mask);
  for (int i = 0; i < 10; ++i) Append(cache, 5);  // keeps positions >= 36
  // A query at 45 needs keys >= 38: still there.
  EXPECT_TRUE(cache.CheckTruncate(45).ok());
  // A query at 40 needs keys >= 33, but block [32, 36) is gone.
  absl::Status status = cache.CheckTruncate(40);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("already dropped"), absl::string_view::npos)
      << status;
  // Keys from 36 on are held: a query at 43 needs keys from 36.
  EXPECT_EQ(cache.ShortestTruncation(), 43);
  EXPECT_FALSE(cache.CheckTruncate(42).ok());
  EXPECT_TRUE(cache.CheckTruncate(43).ok());
  EXPECT_TRUE(cache.CheckTruncate(0).ok()) << "an empty layer needs no key";
  cache.Truncate(45);
  EXPECT_EQ(cache.length(), 45);
  EXPECT_EQ(cache.referenced_blocks(), 3);  // [36, 48)
}

// The table of a window layer stores no entry for the blocks it dropped:
// its memory follows the window, however long the layer grows, and so do
// its views and a staged append's (which list the blocks held and the run
// dropped), while they still address blocks from position 0.
TEST_F(LayerKvCacheTest, AWindowLayersTableFollowsItsWindowNotItsLength) {
  LayerSpec mask;
  mask.window = 8;
  mask.num_sink_tokens = 2;
  LayerKvCache cache(pool_.get(), layout_, mask);
  HostTensor sinks = Append(cache, 2);
  HostTensor last;
  for (int i = 2; i < 400; ++i) last = Append(cache, 1);  // 100 blocks
  // Sinks (block 0) and keys >= 400 - 8 + 1 - 4 = 389 (blocks 97..99).
  EXPECT_EQ(cache.referenced_blocks(), 1 + 3);
  EXPECT_EQ(cache.table_bytes(), 4 * kBlockTableEntryBytes);
  EXPECT_EQ(cache.FirstHeldPosition(), 97 * 4);
  std::vector<const std::byte*> ks, vs;
  const KvView view = cache.view(&ks, &vs);
  EXPECT_EQ(view.k_blocks.size(), 4u);
  EXPECT_EQ(view.gap_begin, 1);
  EXPECT_EQ(view.gap_blocks, 96);
  EXPECT_NE(view.k_block(0), nullptr);
  EXPECT_EQ(view.k_block(1), nullptr);
  EXPECT_EQ(view.k_block(96), nullptr);
  EXPECT_NE(view.k_block(97), nullptr);
  EXPECT_EQ(view.v_block(97), view.k_block(97) + layout_.value_offset_bytes());
  {
    // The next append stages the held blocks and one new one.
    absl::StatusOr<LayerKvCache::PendingAppend> pending =
        cache.PrepareAppend(1);
    ASSERT_TRUE(pending.ok()) << pending.status();
    const KvView staged = pending->view();
    EXPECT_EQ(staged.k_blocks.size(), 5u);
    EXPECT_EQ(staged.length, 401);
    EXPECT_EQ(staged.k_block(97), view.k_block(97));
    EXPECT_EQ(staged.k_block(50), nullptr);
    const KvWrite write = pending->write_target();
    EXPECT_EQ(write.blocks.size(), 5u);
    EXPECT_EQ(write.num_blocks(), 101);
    EXPECT_NE(write.block(100), nullptr);
    EXPECT_EQ(write.block(100), staged.k_block(100));
  }
  EXPECT_EQ(KeyAt(cache, 1, 1, 3), sinks.values[(1 * kHeads + 1) * kDim + 3]);
  EXPECT_EQ(KeyAt(cache, 399, 0, 2), last.values[2]);
  // A fork shares the compact table; writing its tail copies that block.
  LayerKvCache child = cache.Fork();
  EXPECT_EQ(child.table_bytes(), cache.table_bytes());
  HostTensor child_keys = Append(child, 1);
  EXPECT_EQ(KeyAt(child, 400, 1, 1), child_keys.values[kDim + 1]);
  EXPECT_EQ(KeyAt(cache, 399, 0, 2), last.values[2]);
}

// With a window of 1 a layer may be cut back to a block boundary inside
// the blocks it dropped: the next append starts a new block there.
TEST_F(LayerKvCacheTest, ACutInsideTheDroppedBlocksTakesNewOnes) {
  LayerSpec mask;
  mask.window = 1;
  LayerKvCache cache(pool_.get(), layout_, mask);
  for (int i = 0; i < 40; ++i) Append(cache, 1);  // blocks 0..9, 0..7 gone
  ASSERT_TRUE(cache.CheckTruncate(20).ok());
  cache.Truncate(20);  // logical blocks 0..4, all dropped
  EXPECT_EQ(cache.length(), 20);
  EXPECT_EQ(cache.referenced_blocks(), 0);
  EXPECT_EQ(pool_->stats().blocks_used, 0);
  HostTensor next = Append(cache, 3);
  EXPECT_EQ(cache.referenced_blocks(), 1);
  EXPECT_EQ(KeyAt(cache, 22, 1, 0), next.values[(2 * kHeads + 1) * kDim]);
  std::vector<const std::byte*> ks, vs;
  const KvView view = cache.view(&ks, &vs);
  EXPECT_EQ(static_cast<int64_t>(view.k_blocks.size()) + view.gap_blocks, 6);
  EXPECT_EQ(view.k_block(4), nullptr);
  EXPECT_NE(view.k_block(5), nullptr);
  cache.Truncate(0);
  EXPECT_EQ(pool_->stats().blocks_used, 0);
  Append(cache, 5);
  EXPECT_EQ(cache.referenced_blocks(), 2);
}

TEST_F(LayerKvCacheTest, TruncateReleasesBlocksPastTheEnd) {
  LayerKvCache cache(pool_.get(), layout_, LayerSpec{});
  Append(cache, 17);
  EXPECT_EQ(pool_->stats().blocks_used, 5);
  cache.Truncate(8);
  EXPECT_EQ(cache.length(), 8);
  EXPECT_EQ(pool_->stats().blocks_used, 2);
  cache.Truncate(100);  // longer than the layer: no change
  EXPECT_EQ(cache.length(), 8);
}

// The blocks a restore takes, counted without a walk over them (an import
// sizes itself from an untrusted header), are exactly the blocks holding a
// carried position, or the one the next position goes to.
TEST(LayerKvCacheRestoreTest, RestoreBlocksCountsTheCarriedBlocks) {
  for (int64_t tpb : {1, 3, 4, 16}) {
    KvBlockLayout layout;
    layout.tokens_per_block = tpb;
    for (int sinks : {0, 1, 4, 5}) {
      LayerSpec mask;
      mask.window = 8;
      mask.num_sink_tokens = sinks;
      for (int64_t length = 0; length <= 40; ++length) {
        for (int64_t first = 0; first <= length; ++first) {
          const CarriedRanges ranges = CarriedPositions(length, sinks, first);
          int64_t expected = 0;
          for (int64_t b = 0; b * tpb < length; ++b) {
            const int64_t begin = b * tpb;
            const int64_t end = begin + tpb;
            expected += begin < ranges.sink_end ||
                        (end > ranges.window_start && begin < length);
          }
          EXPECT_EQ(LayerKvCache::RestoreBlocks(layout, mask, length, first),
                    expected)
              << "tpb " << tpb << " sinks " << sinks << " length " << length
              << " first " << first;
        }
      }
    }
  }
  // A header's largest lengths cost nothing to size.
  KvBlockLayout layout;
  layout.tokens_per_block = 1;
  EXPECT_EQ(
      LayerKvCache::RestoreBlocks(layout, LayerSpec{}, int64_t{1} << 50, 0),
      int64_t{1} << 50);
}

// A restored window layer's table, and the blocks its restore writes
// through, follow the blocks it carries, not its length: a header may
// claim any length up to max_tokens.
TEST_F(LayerKvCacheTest, ARestoredWindowLayerListsOnlyItsCarriedBlocks) {
  LayerSpec mask;
  mask.window = 8;
  mask.num_sink_tokens = 2;
  constexpr int64_t kLength = int64_t{1} << 20;  // 262144 blocks of 4
  const int64_t first = kLength - 8;
  ASSERT_EQ(LayerKvCache::RestoreBlocks(layout_, mask, kLength, first), 3);
  absl::StatusOr<LayerKvCache> layer = LayerKvCache::Restore(
      pool_.get(), layout_, mask, kLength, first, nullptr, nullptr);
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ(layer->referenced_blocks(), 3);
  EXPECT_EQ(layer->table_bytes(), 3 * kBlockTableEntryBytes);
  const LayerKvCache::ListedBlocks listed = layer->restore_blocks();
  EXPECT_EQ(listed.blocks.size(), 3u);
  EXPECT_EQ(listed.gap_begin, 1);
  EXPECT_EQ(listed.gap_blocks, kLength / 4 - 3);
  KvWrite write;
  write.blocks = listed.blocks;
  write.gap_begin = listed.gap_begin;
  write.gap_blocks = listed.gap_blocks;
  EXPECT_EQ(write.num_blocks(), kLength / 4);
  EXPECT_NE(write.block(0), nullptr);
  EXPECT_EQ(write.block(1), nullptr);
  EXPECT_NE(write.block(kLength / 4 - 2), nullptr);
  EXPECT_EQ(layer->FirstHeldPosition(), first);
}

TEST_F(LayerKvCacheTest, DestructionReleasesEverything) {
  {
    LayerKvCache cache(pool_.get(), layout_, LayerSpec{});
    Append(cache, 30);
    LayerKvCache fork = cache.Fork();
    Append(fork, 3);
  }
  EXPECT_EQ(pool_->stats().blocks_used, 0);
}

}  // namespace
}  // namespace attention

// TenantUsage: the quota check of a reservation counts the tenant's blocks
// and the blocks reserved for appends in flight, and blocks taken under a
// reservation move from one count to the other in one step.
#include "core/tenant_usage.h"

#include <vector>

#include "absl/status/status.h"
#include "core/block_pool.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

constexpr int64_t kBlockBytes = 256;

TenantQuota QuotaOfBlocks(int64_t blocks) {
  TenantQuota quota;
  quota.max_kv_bytes = blocks * kBlockBytes;
  return quota;
}

TEST(TenantUsageTest, ReservationsCountAgainstTheQuotaUntilReleased) {
  TenantUsage usage("team-a", kBlockBytes);
  const TenantQuota quota = QuotaOfBlocks(8);
  ASSERT_TRUE(usage.Reserve(6, quota).ok());
  EXPECT_EQ(usage.Reserve(3, quota).code(),
            absl::StatusCode::kResourceExhausted);
  usage.Unreserve(6);
  EXPECT_TRUE(usage.Reserve(8, quota).ok());
  usage.Unreserve(8);
  EXPECT_EQ(usage.stats().kv_bytes, 0);
}

TEST(TenantUsageTest, TakenBlocksCountOnceAndTheRestStaysReserved) {
  TenantUsage usage("team-a", kBlockBytes);
  const TenantQuota quota = QuotaOfBlocks(8);
  ASSERT_TRUE(usage.Reserve(4, quota).ok());
  {
    BlockReservation reservation(&usage, 4);
    // Two of the four reserved blocks are taken (kNoBlock is skipped).
    const std::vector<BlockId> taken = {3, kNoBlock, 5};
    reservation.Take(taken);
    EXPECT_EQ(usage.stats().kv_bytes, 2 * kBlockBytes);
    // 2 referenced + 2 still reserved: 4 more fit the quota of 8, 5 do not
    // (counted twice, the taken blocks would leave room for 2 only).
    EXPECT_EQ(usage.Reserve(5, quota).code(),
              absl::StatusCode::kResourceExhausted);
    ASSERT_TRUE(usage.Reserve(4, quota).ok());
    usage.Unreserve(4);
  }
  // The reservation's rest went with it; the taken blocks stay referenced.
  EXPECT_EQ(usage.stats().kv_bytes, 2 * kBlockBytes);
  EXPECT_TRUE(usage.Reserve(6, quota).ok());
  usage.Unreserve(6);
  usage.UnrefAll(std::vector<BlockId>{3, 5});
  EXPECT_EQ(usage.stats().kv_bytes, 0);
  EXPECT_TRUE(usage.Reserve(8, quota).ok());
  usage.Unreserve(8);
}

TEST(TenantUsageTest, ABlockTheTenantAlreadyHoldsCountsOnce) {
  TenantUsage usage("team-a", kBlockBytes);
  const TenantQuota quota = QuotaOfBlocks(8);
  usage.RefAll(std::vector<BlockId>{1, 2});
  usage.RefAll(std::vector<BlockId>{2});  // a fork shares block 2
  EXPECT_EQ(usage.stats().kv_bytes, 2 * kBlockBytes);
  EXPECT_TRUE(usage.Reserve(6, quota).ok());
  usage.Unreserve(6);
  usage.UnrefAll(std::vector<BlockId>{2});
  EXPECT_EQ(usage.stats().kv_bytes, 2 * kBlockBytes);
  usage.UnrefAll(std::vector<BlockId>{1, 2});
  EXPECT_EQ(usage.stats().kv_bytes, 0);
}

}  // namespace
}  // namespace attention

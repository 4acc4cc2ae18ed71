// TenantQueueShare: a tenant's waiting items and bytes are bounded, other
// tenants are not affected, a refusal counts nothing and says what to do,
// a tenant with nothing waiting may always queue one submission, and
// shares of a queue's bounds round down to at least one item.
#include "server/tenant_queue_share.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(TenantQueueShareTest, BoundsEachTenantOnItsOwn) {
  TenantQueueShare share("decode steps", {/*max_items=*/2, /*max_bytes=*/100});
  EXPECT_TRUE(share.Admit("a", 1, 10).ok());
  EXPECT_TRUE(share.Admit("a", 1, 10).ok());
  const absl::Status refused = share.Admit("a", 1, 10);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(
      refused.message(),
      "tenant 'a' already has 2 decode steps waiting (20 bytes); 1 more "
      "(10 bytes) would pass its share of the queue, 2 decode steps and 100 "
      "bytes (--tenant_queue_share)"))
      << refused;
  EXPECT_EQ(share.waiting_items("a"), 2);  // the refusal counted nothing
  // Another tenant has its own share.
  EXPECT_TRUE(share.Admit("b", 2, 100).ok());
  EXPECT_EQ(share.Admit("b", 1, 0).code(),
            absl::StatusCode::kResourceExhausted);
  // Bytes bound too.
  share.Release("b", 2, 100);
  EXPECT_TRUE(share.Admit("b", 1, 60).ok());
  EXPECT_EQ(share.Admit("b", 1, 41).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(share.Admit("b", 1, 40).ok());
  // What ran makes room again.
  share.Release("a", 1, 10);
  EXPECT_EQ(share.waiting_items("a"), 1);
  EXPECT_TRUE(share.Admit("a", 1, 10).ok());
}

TEST(TenantQueueShareTest, ATenantWithNothingWaitingMayQueueOneSubmission) {
  TenantQueueShare share("decode steps", {/*max_items=*/2, /*max_bytes=*/100});
  // A BatchDecode of more steps (and bytes) than the share still runs...
  EXPECT_TRUE(share.Admit("a", 5, 1000).ok());
  EXPECT_EQ(share.waiting_items("a"), 5);
  // ...alone: nothing more of the tenant waits beside it.
  EXPECT_EQ(share.Admit("a", 1, 1).code(),
            absl::StatusCode::kResourceExhausted);
  share.Release("a", 5, 1000);
  EXPECT_EQ(share.waiting_items("a"), 0);
  EXPECT_TRUE(share.Admit("a", 1, 1).ok());
}

TEST(TenantQueueShareTest, ReadmittedItemsCountWithoutACheck) {
  TenantQueueShare share("decode steps", {/*max_items=*/1, /*max_bytes=*/100});
  ASSERT_TRUE(share.Admit("a", 1, 10).ok());
  share.Release("a", 1, 10);  // taken into a batch
  ASSERT_TRUE(share.Admit("a", 1, 10).ok());
  share.Readmit("a", 1, 10);  // the first came back: its session was busy
  EXPECT_EQ(share.waiting_items("a"), 2);
  EXPECT_EQ(share.Admit("a", 1, 10).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(TenantQueueShareTest, UnboundedCountsNothing) {
  TenantQueueShare share("prefills", TenantQueueBounds());
  EXPECT_FALSE(share.bounds().bounded());
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(share.Admit("a", 1000, 1).ok());
  EXPECT_EQ(share.waiting_items("a"), 0);
  share.Release("a", 1, 1);  // harmless
}

TEST(TenantQueueShareTest, SharesOfAQueuesBounds) {
  EXPECT_FALSE(TenantQueueBounds::ShareOf(1.0, 4096, 1 << 30).bounded());
  const TenantQueueBounds half = TenantQueueBounds::ShareOf(0.5, 4096, 1000);
  EXPECT_EQ(half.max_items, 2048);
  EXPECT_EQ(half.max_bytes, 500);
  // At least one item; bytes may round to 0 (one submission at a time).
  const TenantQueueBounds tiny = TenantQueueBounds::ShareOf(0.1, 3, 5);
  EXPECT_EQ(tiny.max_items, 1);
  EXPECT_EQ(tiny.max_bytes, 0);
  EXPECT_TRUE(tiny.bounded());
}

}  // namespace
}  // namespace attention::server

// Placement of new sessions (client/placement.h) and the cluster target
// syntax (client/cluster_target.h).
#include "client/placement.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cluster_target.h"
#include "gtest/gtest.h"

namespace attention::client {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

ReplicaLoad Load(std::string address, int64_t free_bytes,
                 bool accepting = true) {
  return ReplicaLoad{std::move(address), accepting, free_bytes, 4 * kGiB};
}

std::string First(const std::vector<ReplicaLoad>& replicas,
                  const std::string& key, bool keyed) {
  std::vector<std::string> order =
      PlacementOrder(replicas, key, keyed, 1.0 / 32);
  return order.empty() ? "" : order.front();
}

TEST(RendezvousWeightTest, IsAFixedFunctionOfKeyAndAddress) {
  EXPECT_EQ(RendezvousWeight("user-1", "10.0.0.1:50051"),
            RendezvousWeight("user-1", "10.0.0.1:50051"));
  EXPECT_NE(RendezvousWeight("user-1", "10.0.0.1:50051"),
            RendezvousWeight("user-2", "10.0.0.1:50051"));
  EXPECT_NE(RendezvousWeight("user-1", "10.0.0.1:50051"),
            RendezvousWeight("user-1", "10.0.0.2:50051"));
  // The separator keeps the two strings apart.
  EXPECT_NE(RendezvousWeight("ab", "c"), RendezvousWeight("a", "bc"));
}

TEST(PlacementOrderTest, MostFreeReplicaFirstThenByFreeBytes) {
  const std::vector<ReplicaLoad> replicas = {
      Load("a:1", 1 * kGiB), Load("b:1", 3 * kGiB), Load("c:1", 2 * kGiB)};
  for (int nonce = 0; nonce < 20; ++nonce) {
    EXPECT_EQ(PlacementOrder(replicas, absl::StrCat(nonce), false, 1.0 / 32),
              (std::vector<std::string>{"b:1", "c:1", "a:1"}));
  }
}

TEST(PlacementOrderTest, ExtremeReportsAreOrderedWithoutOverflow) {
  // Whatever replicas report (run under UBSan in CI): negative free bytes
  // count as none, a fraction over 1 ties every replica.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::vector<ReplicaLoad> replicas = {
      ReplicaLoad{"a:1", true, kMax, kMax},
      ReplicaLoad{"b:1", true, std::numeric_limits<int64_t>::min(), kMax},
      ReplicaLoad{"c:1", true, kMax / 2, -1}};
  EXPECT_EQ(PlacementOrder(replicas, "k", false, 0.0),
            (std::vector<std::string>{"a:1", "c:1", "b:1"}));
  std::vector<std::string> tied = PlacementOrder(replicas, "k", false, 5.0);
  std::sort(tied.begin(), tied.end());
  EXPECT_EQ(tied, (std::vector<std::string>{"a:1", "b:1", "c:1"}));
}

TEST(PlacementOrderTest, NeverDrainingOrNotServing) {
  const std::vector<ReplicaLoad> replicas = {
      Load("a:1", 1 * kGiB), Load("b:1", 4 * kGiB, /*accepting=*/false),
      Load("c:1", 2 * kGiB)};
  for (bool keyed : {false, true}) {
    for (int key = 0; key < 50; ++key) {
      const std::vector<std::string> order =
          PlacementOrder(replicas, absl::StrCat("k", key), keyed, 1.0 / 32);
      ASSERT_EQ(order.size(), 2u);
      EXPECT_NE(order[0], "b:1");
      EXPECT_NE(order[1], "b:1");
    }
  }
  EXPECT_TRUE(
      PlacementOrder({Load("a:1", kGiB, false)}, "k", false, 0.1).empty());
  EXPECT_TRUE(PlacementOrder({}, "k", true, 0.1).empty());
}

TEST(PlacementOrderTest, NearTiesAreDecidedByRendezvousHashing) {
  // Within 1/32 of 4 GiB (128 MiB) of each other: tied.
  const std::vector<ReplicaLoad> replicas = {
      Load("a:1", 3 * kGiB), Load("b:1", 3 * kGiB - (100 << 20)),
      Load("c:1", 3 * kGiB - (50 << 20)), Load("d:1", 1 * kGiB)};
  std::map<std::string, int> firsts;
  for (int nonce = 0; nonce < 3000; ++nonce) {
    const std::string key = absl::StrCat("nonce-", nonce);
    const std::vector<std::string> order =
        PlacementOrder(replicas, key, false, 1.0 / 32);
    ASSERT_EQ(order.size(), 4u);
    EXPECT_EQ(order[3], "d:1");  // not tied: after every tied replica
    // The tied ones by decreasing weight.
    for (int i = 0; i + 1 < 3; ++i) {
      EXPECT_GT(RendezvousWeight(key, order[i]),
                RendezvousWeight(key, order[i + 1]));
    }
    ++firsts[order[0]];
  }
  // Random keys spread evenly over the tied replicas.
  for (const char* address : {"a:1", "b:1", "c:1"}) {
    EXPECT_GT(firsts[address], 800) << address;
    EXPECT_LT(firsts[address], 1200) << address;
  }
}

TEST(PlacementOrderTest, APlacementKeyDecidesAloneAndMovesOnlyItsOwnKeys) {
  const std::vector<ReplicaLoad> three = {
      Load("a:1", 1 * kGiB), Load("b:1", 4 * kGiB), Load("c:1", 2 * kGiB)};
  std::map<std::string, int> firsts;
  int moved = 0;
  for (int user = 0; user < 300; ++user) {
    const std::string key = absl::StrCat("user-", user);
    const std::string chosen = First(three, key, true);
    // The same key lands on the same replica however loads change.
    std::vector<ReplicaLoad> reloaded = three;
    for (ReplicaLoad& load : reloaded) load.kv_free_bytes = kGiB / 2;
    EXPECT_EQ(First(reloaded, key, true), chosen);
    ++firsts[chosen];
    // Removing another replica keeps the key where it is; removing its
    // replica moves it to its second choice.
    for (const ReplicaLoad& removed : three) {
      std::vector<ReplicaLoad> two;
      for (const ReplicaLoad& load : three) {
        if (load.address != removed.address) two.push_back(load);
      }
      if (removed.address != chosen) {
        EXPECT_EQ(First(two, key, true), chosen);
      } else {
        EXPECT_EQ(First(two, key, true),
                  PlacementOrder(three, key, true, 1.0 / 32)[1]);
        ++moved;
      }
    }
  }
  EXPECT_EQ(moved, 300);  // exactly one removal moves each key
  for (const char* address : {"a:1", "b:1", "c:1"}) {
    EXPECT_GT(firsts[address], 60) << address;
  }
}

TEST(ClusterTargetTest, ListsAndNames) {
  auto list = ParseClusterTarget("10.0.0.2:50051, 10.0.0.1:50051,[::1]:7");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->fixed);
  EXPECT_EQ(list->addresses,
            (std::vector<std::string>{"10.0.0.1:50051", "10.0.0.2:50051",
                                      "[::1]:7"}));
  auto resolved = ResolveClusterTarget(*list);
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(*resolved, list->addresses);

  auto name = ParseClusterTarget(
      "dns:///attention-server-headless.ns.svc.cluster.local:50051");
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_FALSE(name->fixed);
  EXPECT_EQ(name->host, "attention-server-headless.ns.svc.cluster.local");
  EXPECT_EQ(name->port, "50051");

  auto loopback = ParseClusterTarget("127.0.0.1:9");
  ASSERT_TRUE(loopback.ok());
  auto addresses = ResolveClusterTarget(*loopback);
  ASSERT_TRUE(addresses.ok()) << addresses.status();
  EXPECT_EQ(*addresses, std::vector<std::string>{"127.0.0.1:9"});

  for (const char* bad : {"", "host", "host:", ":80", "host:0", "host:99999",
                          "a:1,b", "[::1]7", ",", " , ,"}) {
    auto parsed = ParseClusterTarget(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  auto unknown = ParseClusterTarget("no-such-host.invalid:50051");
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(ResolveClusterTarget(*unknown).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attention::client

// Tenants in the engine: every session belongs to its creator, another
// tenant's session answers exactly as an unknown one, and per-tenant quotas
// (sessions, KV bytes with shared fork blocks counted once) refuse what
// would pass them, change nothing, and recover after deletes.
#include "core/tenant.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "tests/core/test_tensors.h"

namespace attention {
namespace {

using testing::HostTensor;
using testing::RandomTensor;

// 1 head of 8 + 8 float32: 64 bytes a token, 4 tokens a 256-byte block.
constexpr int64_t kBlockBytes = 256;
constexpr int64_t kTokensPerBlock = 4;

SessionSpec Spec() {
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = 1;
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  spec.value_dim = 8;
  spec.max_tokens = 1024;
  spec.layers = {LayerSpec{}};
  return spec;
}

class TenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.kv_cache_bytes = 64 * kBlockBytes;
    options.kv_block_bytes = kBlockBytes;
    options.sessions.reap_interval = absl::ZeroDuration();
    auto engine =
        AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    alice_.name = "alice";
    bob_.name = "bob";
  }

  std::string Create(const Tenant& tenant) {
    auto info = engine_->CreateSession(Spec(), absl::ZeroDuration(), tenant);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->session_id : "";
  }

  // `tokens` random tokens for session `id` of `tenant`.
  AppendRequest Tokens(const std::string& id, int64_t tokens,
                       const Tenant& tenant) {
    held_.push_back(RandomTensor({tokens, 1, 8}, rng_));
    AppendRequest request;
    request.session_id = id;
    request.q = held_.back().rows(0, tokens);
    held_.push_back(RandomTensor({tokens, 1, 8}, rng_));
    request.k = held_.back().rows(0, tokens);
    held_.push_back(RandomTensor({tokens, 1, 8}, rng_));
    request.v = held_.back().rows(0, tokens);
    request.tenant = &tenant;
    return request;
  }

  int64_t Length(const std::string& id, const Tenant& tenant) {
    auto info = engine_->GetSession(id, tenant);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->layer_lengths[0] : -1;
  }

  std::unique_ptr<AttentionEngine> engine_;
  Tenant alice_, bob_;
  std::mt19937 rng_{7};
  std::vector<HostTensor> held_;
};

TEST_F(TenantTest, AnotherTenantsSessionAnswersAsAnUnknownOne) {
  const std::string mine = Create(alice_);
  ASSERT_TRUE(engine_->Append(Tokens(mine, 5, alice_)).ok());
  const std::string bobs = Create(bob_);

  std::vector<absl::Status> refused = {
      engine_->GetSession(mine, bob_).status(),
      engine_->DeleteSession(mine, bob_),
      engine_->ForkSession(mine, bob_).status(),
      engine_->TruncateSession(mine, 1, bob_).status(),
      engine_->HoldSession(mine, bob_).status(),
      engine_->Append(Tokens(mine, 1, bob_)).status(),
  };
  // A batch naming one foreign session fails whole.
  std::vector<AppendRequest> batch = {Tokens(bobs, 1, bob_),
                                      Tokens(mine, 1, bob_)};
  refused.push_back(engine_->AppendBatch(batch).status());
  for (const absl::Status& status : refused) {
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  }
  EXPECT_EQ(Length(mine, alice_), 5);
  EXPECT_EQ(Length(bobs, bob_), 0);
  ASSERT_EQ(engine_->ListSessions("", 10, bob_).size(), 1u);
  EXPECT_EQ(engine_->ListSessions("", 10, bob_)[0].session_id, bobs);
  ASSERT_EQ(engine_->ListSessions("", 10, alice_).size(), 1u);
  EXPECT_TRUE(engine_->ListSessions("", 10).empty());  // tenant `default`

  // The same message as for an id that does not exist (any more).
  ASSERT_TRUE(engine_->DeleteSession(mine, alice_).ok());
  const absl::Status gone = engine_->GetSession(mine, alice_).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(refused[0].message(), gone.message());
  EXPECT_EQ(refused.back().message(), absl::StrCat("step 1: ", gone.message()));
}

TEST_F(TenantTest, ForksBelongToTheSameTenant) {
  const std::string parent = Create(alice_);
  auto fork = engine_->ForkSession(parent, alice_);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_TRUE(engine_->GetSession(fork->session_id, alice_).ok());
  EXPECT_EQ(engine_->GetSession(fork->session_id, bob_).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->tenant_stats("alice").sessions, 2);
}

TEST_F(TenantTest, SessionQuotaRefusesThenRecovers) {
  alice_.quota.max_sessions = 2;
  const std::string first = Create(alice_);
  Create(alice_);
  const absl::Status created =
      engine_->CreateSession(Spec(), absl::ZeroDuration(), alice_).status();
  EXPECT_EQ(created.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(created.message().find("max_sessions is 2"), std::string::npos)
      << created;
  EXPECT_NE(created.message().find("holds 2"), std::string::npos) << created;
  EXPECT_EQ(engine_->ForkSession(first, alice_).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->tenant_stats("alice").sessions, 2);
  // Other tenants are not limited by alice's quota.
  Create(bob_);
  Create(bob_);
  Create(bob_);
  ASSERT_TRUE(engine_->DeleteSession(first, alice_).ok());
  EXPECT_TRUE(
      engine_->CreateSession(Spec(), absl::ZeroDuration(), alice_).ok());
}

TEST_F(TenantTest, KvQuotaCountsSharedBlocksOnceAndChangesNothingWhenFull) {
  alice_.quota.max_kv_bytes = 3 * kBlockBytes;
  const std::string id = Create(alice_);
  // 2 blocks (8 tokens).
  ASSERT_TRUE(engine_->Append(Tokens(id, 2 * kTokensPerBlock, alice_)).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 2 * kBlockBytes);
  // A fork shares both blocks: still 2 blocks for the tenant.
  auto fork = engine_->ForkSession(id, alice_);
  ASSERT_TRUE(fork.ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 2 * kBlockBytes);
  // 2 more blocks would make 4 of 3.
  const int64_t pool_before = engine_->stats().pool.used_bytes;
  const absl::Status full =
      engine_->Append(Tokens(id, 2 * kTokensPerBlock, alice_)).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("max_kv_bytes of 768"), std::string::npos)
      << full;
  EXPECT_NE(full.message().find("uses 512 bytes"), std::string::npos) << full;
  EXPECT_EQ(Length(id, alice_), 2 * kTokensPerBlock);
  EXPECT_EQ(engine_->stats().pool.used_bytes, pool_before);
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 2 * kBlockBytes);
  // One block still fits, in either session.
  ASSERT_TRUE(engine_->Append(Tokens(fork->session_id, 1, alice_)).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 3 * kBlockBytes);
  EXPECT_EQ(engine_->Append(Tokens(id, 1, alice_)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Bob has no quota; alice's usage does not count for him.
  const std::string bobs = Create(bob_);
  EXPECT_TRUE(engine_->Append(Tokens(bobs, 8 * kTokensPerBlock, bob_)).ok());
  EXPECT_EQ(engine_->tenant_stats("bob").kv_bytes, 8 * kBlockBytes);
  // Deleting the fork frees its private block: alice can append again.
  ASSERT_TRUE(engine_->DeleteSession(fork->session_id, alice_).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 2 * kBlockBytes);
  EXPECT_TRUE(engine_->Append(Tokens(id, 1, alice_)).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").sessions, 1);
}

// A quota lowered below what the tenant holds (a tokens-file reload)
// refuses appends that need a new block, not those that fit in the blocks
// the tenant has: they add nothing.
TEST_F(TenantTest, ALoweredKvQuotaStillTakesAppendsThatNeedNoBlock) {
  const std::string id = Create(alice_);
  ASSERT_TRUE(engine_->Append(Tokens(id, 3, alice_)).ok());  // 1 block
  alice_.quota.max_kv_bytes = 0;
  ASSERT_TRUE(engine_->Append(Tokens(id, 1, alice_)).ok());  // fills it
  EXPECT_EQ(Length(id, alice_), kTokensPerBlock);
  EXPECT_EQ(engine_->Append(Tokens(id, 1, alice_)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Length(id, alice_), kTokensPerBlock);
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, kBlockBytes);
}

// In an AppendEach batch a step that fails after reserving its blocks
// (the pool is full) gives the reservation back at once: the tenant's other
// step is judged by its quota as it would be alone.
TEST_F(TenantTest, AFailedStepOfABatchHoldsNoReservation) {
  const std::string bobs = Create(bob_);
  ASSERT_TRUE(engine_->Append(Tokens(bobs, 62 * kTokensPerBlock, bob_)).ok());
  alice_.quota.max_kv_bytes = 4 * kBlockBytes;
  const std::string big = Create(alice_);
  const std::string small = Create(alice_);
  auto each = engine_->AppendEach(
      {Tokens(big, 4 * kTokensPerBlock, alice_), Tokens(small, 1, alice_)});
  EXPECT_EQ(each[0].status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(each[0].status().message().find("max_kv_bytes"), std::string::npos)
      << "the pool, not the quota: " << each[0].status();
  ASSERT_TRUE(each[1].ok()) << each[1].status();
  EXPECT_EQ(Length(small, alice_), 1);
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, kBlockBytes);
}

TEST_F(TenantTest, TruncateReleasesTheTenantsBlocks) {
  const std::string id = Create(alice_);
  ASSERT_TRUE(engine_->Append(Tokens(id, 3 * kTokensPerBlock, alice_)).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 3 * kBlockBytes);
  ASSERT_TRUE(engine_->TruncateSession(id, kTokensPerBlock, alice_).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, kBlockBytes);
  ASSERT_TRUE(engine_->DeleteSession(id, alice_).ok());
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes, 0);
  EXPECT_EQ(engine_->tenant_stats("alice").sessions, 0);
  EXPECT_EQ(engine_->tenant_stats("nobody").sessions, 0);
}

}  // namespace
}  // namespace attention

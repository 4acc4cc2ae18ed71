// SessionHolds over a real engine: held sessions do not expire until the
// set lets them go, a used one restarts its idle clock then, a dead hold is
// dropped at the next Hold of its id, and the holds of sessions that are
// gone are dropped as the set grows (a Decode stream that outlives many
// sessions keeps no entry per session it ever used).
#include "core/session_holds.h"

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "core/session_export.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

SessionSpec Spec() {
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = 1;
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  spec.value_dim = 8;
  spec.max_tokens = 64;
  spec.layers = {LayerSpec{}};
  return spec;
}

class SessionHoldsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions options;
    options.kv_cache_bytes = 1 << 20;
    options.kv_block_bytes = 4096;
    options.sessions.reap_interval = absl::ZeroDuration();
    options.sessions.now = [this] { return now_; };
    auto engine =
        AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  // A new session idle for at most `idle_timeout`.
  std::string Create(absl::Duration idle_timeout = absl::Seconds(10)) {
    auto info = engine_->CreateSession(Spec(), idle_timeout);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->session_id : "";
  }

  // Whether session `id` is there, read without restarting its idle clock
  // (an export does not).
  bool Alive(const std::string& id) { return engine_->ExportSession(id).ok(); }

  // The idle deadline (unix seconds) of session `id`, as its export says.
  int64_t Deadline(const std::string& id) {
    auto exported = engine_->ExportSession(id);
    EXPECT_TRUE(exported.ok()) << exported.status();
    return exported.ok() ? (*exported)->header().idle_deadline_unix_ms / 1000
                         : -1;
  }

  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::unique_ptr<AttentionEngine> engine_;
};

TEST_F(SessionHoldsTest, HeldSessionsDoNotExpireUntilLetGo) {
  SessionHolds holds(engine_.get());
  const std::string used = Create();
  const std::string unused = Create();
  const std::string free = Create();
  ASSERT_TRUE(holds.Hold(used, DefaultTenant()).ok());
  ASSERT_TRUE(holds.Hold(unused, DefaultTenant()).ok());
  ASSERT_TRUE(holds.Hold(used, DefaultTenant()).ok());  // held once
  EXPECT_EQ(holds.size(), 2u);
  holds.MarkUsed(used);
  now_ += absl::Seconds(30);
  EXPECT_FALSE(Alive(free));
  EXPECT_TRUE(Alive(used));
  EXPECT_TRUE(Alive(unused));
  holds.Clear();
  EXPECT_EQ(holds.size(), 0u);
  // The used session's clock restarted as its hold ended; the other's did
  // not, and it was idle for 30 s.
  EXPECT_EQ(Deadline(used), 1040);
  EXPECT_FALSE(Alive(unused));
}

TEST_F(SessionHoldsTest, UnknownSessionsAreNotHeld) {
  SessionHolds holds(engine_.get());
  EXPECT_EQ(holds.Hold("no-such-session", DefaultTenant()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(holds.size(), 0u);
  Tenant other;
  other.name = "other";
  const std::string id = Create();
  EXPECT_EQ(holds.Hold(id, other).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(holds.size(), 0u);
}

// A session deleted while held (DeleteSession frees a held session at
// once) leaves a dead hold, which the next Hold of its id drops: NOT_FOUND
// while no session has the id.
TEST_F(SessionHoldsTest, AHoldOfAGoneSessionIsDroppedAtItsNextHold) {
  SessionHolds holds(engine_.get());
  const std::string id = Create();
  ASSERT_TRUE(holds.Hold(id, DefaultTenant()).ok());
  ASSERT_TRUE(engine_->DeleteSession(id).ok());
  EXPECT_EQ(holds.size(), 1u);
  EXPECT_EQ(holds.Hold(id, DefaultTenant()).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(holds.size(), 0u);
}

// One long-lived session and thousands made, used and deleted after it:
// the set keeps at most kMinSweep entries, the live session's among them.
TEST_F(SessionHoldsTest, HoldsOfGoneSessionsAreDroppedAsTheSetGrows) {
  SessionHolds holds(engine_.get());
  const std::string kept = Create();
  ASSERT_TRUE(holds.Hold(kept, DefaultTenant()).ok());
  for (int i = 0; i < 5000; ++i) {
    const std::string id = Create();
    ASSERT_TRUE(holds.Hold(id, DefaultTenant()).ok());
    ASSERT_TRUE(engine_->DeleteSession(id).ok());
    ASSERT_LE(holds.size(), SessionHolds::kMinSweep) << "after " << i;
  }
  now_ += absl::Seconds(30);
  EXPECT_TRUE(Alive(kept));
  holds.Clear();
  EXPECT_FALSE(Alive(kept));
}

}  // namespace
}  // namespace attention

#include "core/session_manager.h"

#include <atomic>
#include <iterator>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/moved_sessions.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

SessionSpec SmallSpec() {
  SessionSpec spec;
  spec.num_layers = 2;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 8;
  return spec;
}

class SessionManagerTest : public ::testing::Test {
 protected:
  SessionManager MakeManager(int64_t max_sessions = 100) {
    SessionManagerOptions options;
    options.reap_interval = absl::ZeroDuration();
    options.default_idle_timeout = absl::Seconds(30);
    options.max_sessions = max_sessions;
    options.now = [this] { return now_; };
    return SessionManager(pool_.get(), options);
  }

  CpuBackend backend_{1};
  std::unique_ptr<BlockPool> pool_ =
      *BlockPool::Create(&backend_, 1 << 20, 4096);
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

TEST_F(SessionManagerTest, IdsAreLongRandomAndUnique) {
  SessionManager manager = MakeManager(1000);
  std::set<std::string> ids;
  for (int i = 0; i < 200; ++i) {
    auto session = manager.Create(SmallSpec(), absl::ZeroDuration());
    ASSERT_TRUE(session.ok()) << session.status();
    const std::string& id = (*session)->id();
    EXPECT_EQ(id.size(), 32u) << "128 bits, hex encoded";
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos);
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 200u);
}

TEST_F(SessionManagerTest, CreateResolvesTheSpec) {
  SessionManager manager = MakeManager();
  auto session = *manager.Create(SmallSpec(), absl::ZeroDuration());
  EXPECT_EQ(session->spec().value_dim, 8);
  EXPECT_EQ(session->spec().layers.size(), 2u);
  EXPECT_GT(session->spec().max_tokens, 0);
  EXPECT_FLOAT_EQ(session->spec().scale, 1.0f / std::sqrt(8.0f));
  // 2 KV heads * (8 + 8) floats = 128 bytes per token; 4096-byte blocks.
  EXPECT_EQ(session->layout().tokens_per_block, 32);
  EXPECT_EQ(session->idle_timeout(), absl::Seconds(30));
}

TEST_F(SessionManagerTest, RejectsSpecsThatDoNotFitABlock) {
  SessionManager manager = MakeManager();
  SessionSpec spec = SmallSpec();
  spec.num_kv_heads = 4;
  spec.num_q_heads = 4;
  spec.head_dim = 256;  // 4 * 512 * 4 = 8 KiB per token > 4 KiB block
  auto session = manager.Create(spec, absl::ZeroDuration());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(session.status().message().find("--kv_block_bytes"),
            absl::string_view::npos);
}

TEST_F(SessionManagerTest, RejectsBadTimeouts) {
  SessionManager manager = MakeManager();
  EXPECT_EQ(manager.Create(SmallSpec(), absl::Seconds(-1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager.Create(SmallSpec(), absl::Hours(1000)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionManagerTest, GetDeleteAndNotFound) {
  SessionManager manager = MakeManager();
  auto session = *manager.Create(SmallSpec(), absl::ZeroDuration());
  EXPECT_TRUE(manager.Get(session->id()).ok());
  EXPECT_EQ(manager.Get("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager.Delete(session->id()).ok());
  EXPECT_EQ(manager.Get(session->id()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(manager.Delete(session->id()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager.size(), 0);
}

TEST_F(SessionManagerTest, MaxSessionsIsResourceExhausted) {
  SessionManager manager = MakeManager(2);
  auto first = *manager.Create(SmallSpec(), absl::ZeroDuration());
  ASSERT_TRUE(manager.Create(SmallSpec(), absl::ZeroDuration()).ok());
  EXPECT_EQ(manager.Create(SmallSpec(), absl::ZeroDuration()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(manager.Fork(first->id()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(manager.created_total(), 2);
}

TEST_F(SessionManagerTest, IdleSessionsExpireAndUseResetsTheClock) {
  SessionManager manager = MakeManager();
  auto idle = *manager.Create(SmallSpec(), absl::Seconds(10));
  auto busy = *manager.Create(SmallSpec(), absl::Seconds(10));
  const std::string idle_id = idle->id();
  idle.reset();
  now_ += absl::Seconds(8);
  {
    auto call = manager.Get(busy->id());  // a call that succeeds
    ASSERT_TRUE(call.ok());
    call->MarkUsed();  // touches `busy` as it ends
  }
  now_ += absl::Seconds(8);
  EXPECT_EQ(manager.ExpireIdle(now_), 1);
  EXPECT_EQ(manager.Get(idle_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager.Get(busy->id()).ok());
  EXPECT_EQ(manager.expired_total(), 1);
}

// A failed call changes nothing: its ref ends without touching the clock.
TEST_F(SessionManagerTest, AFailedCallLeavesTheIdleClock) {
  SessionManager manager = MakeManager();
  const std::string id =
      (*manager.Create(SmallSpec(), absl::Seconds(10)))->id();
  now_ += absl::Seconds(8);
  ASSERT_TRUE(manager.Get(id).ok());  // never marked used
  now_ += absl::Seconds(3);
  EXPECT_EQ(manager.ExpireIdle(now_), 1);
}

TEST_F(SessionManagerTest, GetOfAnExpiredSessionIsNotFound) {
  SessionManager manager = MakeManager();
  const std::string id = (*manager.Create(SmallSpec(), absl::Seconds(5)))->id();
  now_ += absl::Seconds(6);
  EXPECT_EQ(manager.Get(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(manager.expired_total(), 1);
  EXPECT_EQ(manager.size(), 0);
}

// Before the reaper gets to it, an expired session is gone for every
// call, as for Get: Delete, List and an import of its id see no session.
TEST_F(SessionManagerTest, AnExpiredSessionIsGoneBeforeTheReaperRuns) {
  SessionManager manager = MakeManager();
  const std::string deleted =
      (*manager.Create(SmallSpec(), absl::Seconds(5)))->id();
  const std::string listed =
      (*manager.Create(SmallSpec(), absl::Seconds(5)))->id();
  auto reused = manager.Create(SmallSpec(), absl::Seconds(5));
  ASSERT_TRUE(reused.ok());
  const SessionSpec spec = (*reused)->spec();
  const std::string reused_id = (*reused)->id();
  reused->reset();
  now_ += absl::Seconds(6);

  EXPECT_EQ(manager.Delete(deleted).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(manager.List("", 10).empty());
  EXPECT_FALSE(manager.Contains(listed));
  // An import keeping the id of an expired session takes its place.
  EXPECT_FALSE(manager.Contains(reused_id));
  auto layout = manager.LayoutFor(spec);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto import = std::make_shared<Session>(
      reused_id, spec, *layout, pool_.get(), absl::Seconds(5), now_,
      manager.UsageOf(DefaultTenant().name));
  auto reservation = manager.ReserveMetadata(0);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  const absl::Status adopted =
      manager.Adopt(import, TenantQuota{}, *std::move(reservation));
  EXPECT_TRUE(adopted.ok()) << adopted;
  EXPECT_TRUE(manager.Contains(reused_id));
  EXPECT_EQ(manager.expired_total(), 2);  // the deleted one, the replaced one
  EXPECT_EQ(manager.size(), 2);           // the listed one awaits the reaper
}

TEST_F(SessionManagerTest, BackgroundReaperExpiresSessions) {
  SessionManagerOptions options;
  options.reap_interval = absl::Milliseconds(5);
  SessionManager manager(pool_.get(), options);
  ASSERT_TRUE(manager.Create(SmallSpec(), absl::Milliseconds(1)).ok());
  // Bounded wait for the reaper (a condition, not a timing assertion).
  for (int i = 0; i < 2000 && manager.size() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(manager.size(), 0);
  EXPECT_EQ(manager.expired_total(), 1);
}

TEST_F(SessionManagerTest, ForkCopiesSpecAndSharesBlocks) {
  SessionManager manager = MakeManager();
  auto parent = *manager.Create(SmallSpec(), absl::ZeroDuration());
  auto child = manager.Fork(parent->id());
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_NE((*child)->id(), parent->id());
  EXPECT_EQ((*child)->spec(), parent->spec());
  EXPECT_EQ(manager.size(), 2);
  EXPECT_EQ(manager.Fork("missing").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, SessionsInUseNeverExpireAndIdleCountsFromTheEnd) {
  SessionManager manager = MakeManager();
  const std::string id =
      (*manager.Create(SmallSpec(), absl::Seconds(10)))->id();
  {
    auto call = manager.Get(id);  // a call that runs for a minute
    ASSERT_TRUE(call.ok());
    call->MarkUsed();
    now_ += absl::Seconds(60);
    EXPECT_EQ(manager.ExpireIdle(now_), 0);
    EXPECT_TRUE(manager.Get(id).ok()) << "a second call on the same session";
  }
  // Idle time counts from the end of the last call.
  now_ += absl::Seconds(8);
  EXPECT_EQ(manager.ExpireIdle(now_), 0);
  now_ += absl::Seconds(3);
  EXPECT_EQ(manager.ExpireIdle(now_), 1);
  EXPECT_EQ(manager.Get(id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, AHoldKeepsASessionFromExpiringButNotFromDeletion) {
  SessionManager manager = MakeManager();
  const std::string id =
      (*manager.Create(SmallSpec(), absl::Seconds(10)))->id();
  std::weak_ptr<Session> watch;
  {
    auto ref = manager.Get(id);
    ASSERT_TRUE(ref.ok());
    watch = ref->shared();
    SessionHold hold(ref->shared(), manager.clock());
    *ref = SessionRef();  // the call ends; the stream's hold stays
    now_ += absl::Seconds(60);
    EXPECT_EQ(manager.ExpireIdle(now_), 0);
    ASSERT_TRUE(manager.Delete(id).ok());
    EXPECT_TRUE(watch.expired()) << "deleted while held: freed at once";
  }
  EXPECT_EQ(manager.size(), 0);
}

TEST_F(SessionManagerTest, MetadataIsCountedAndBounded) {
  SessionManagerOptions options;
  options.reap_interval = absl::ZeroDuration();
  options.now = [this] { return now_; };
  SessionSpec heavy = SmallSpec();
  heavy.layers.resize(1);
  heavy.layers[0].sink_logits.assign(4, 0.5f);
  heavy.num_layers = 64;
  const int64_t per_session = [&] {
    SessionManager probe(pool_.get(), options);
    auto session = probe.Create(heavy, absl::ZeroDuration());
    EXPECT_TRUE(session.ok());
    EXPECT_EQ(probe.metadata_bytes(), (*session)->metadata_bytes());
    return (*session)->metadata_bytes();
  }();
  // 64 layers of 4 sink logits each, at least.
  EXPECT_GE(per_session, 64 * 4 * 4);
  options.max_metadata_bytes = 2 * per_session + per_session / 2;
  SessionManager manager(pool_.get(), options);
  auto first = manager.Create(heavy, absl::ZeroDuration());
  auto second = manager.Create(heavy, absl::ZeroDuration());
  ASSERT_TRUE(first.ok() && second.ok());
  auto third = manager.Create(heavy, absl::ZeroDuration());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max_session_metadata_bytes"),
            std::string::npos)
      << third.status();
  EXPECT_EQ(manager.Fork((*first)->id()).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(manager.metadata_bytes(), 2 * per_session);
  ASSERT_TRUE(manager.Delete((*first)->id()).ok());
  EXPECT_EQ(manager.metadata_bytes(), per_session);
  EXPECT_TRUE(manager.Create(heavy, absl::ZeroDuration()).ok());
}

TEST_F(SessionManagerTest, LongIdsAreQuotedShortInErrors) {
  SessionManager manager = MakeManager();
  const std::string id(8000, 'x');
  auto missing = manager.Get(id);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(missing.status().message().size(), 300u);
  EXPECT_NE(missing.status().message().find("(8000 bytes)"),
            std::string::npos);
}

TEST_F(SessionManagerTest, ListPagesThroughIdsInOrder) {
  SessionManager manager = MakeManager(1000);
  std::set<std::string> created;
  for (int i = 0; i < 25; ++i) {
    created.insert((*manager.Create(SmallSpec(), absl::ZeroDuration()))->id());
  }
  std::vector<std::string> listed;
  std::string after;
  while (true) {
    auto page = manager.List(after, 7);
    if (page.empty()) break;
    EXPECT_LE(page.size(), 7u);
    for (const auto& session : page) listed.push_back(session->id());
    after = listed.back();
  }
  EXPECT_EQ(listed, std::vector<std::string>(created.begin(), created.end()));
}

Tenant NamedTenant(const std::string& name) {
  Tenant tenant;
  tenant.name = name;
  return tenant;
}

TEST_F(SessionManagerTest, ListPagesThroughOneTenantsSessionsOnly) {
  SessionManager manager = MakeManager(1000);
  const Tenant alice = NamedTenant("alice");
  const Tenant bob = NamedTenant("bob");
  std::set<std::string> alices, bobs;
  for (int i = 0; i < 30; ++i) {
    const Tenant& owner = i % 3 == 0 ? alice : bob;
    auto session = manager.Create(SmallSpec(), absl::ZeroDuration(), owner);
    ASSERT_TRUE(session.ok()) << session.status();
    (i % 3 == 0 ? alices : bobs).insert((*session)->id());
  }
  // Deleted sessions leave the listing; the others keep their order.
  const std::string deleted = *std::next(alices.begin(), 4);
  ASSERT_TRUE(manager.Delete(deleted, alice).ok());
  alices.erase(deleted);
  ASSERT_TRUE(manager.Delete(*bobs.begin(), bob).ok());
  bobs.erase(bobs.begin());
  auto list_all = [&](const Tenant& tenant) {
    std::vector<std::string> listed;
    std::string after;
    while (true) {
      auto page = manager.List(after, 3, tenant);
      if (page.empty()) break;
      EXPECT_LE(page.size(), 3u);
      for (const auto& session : page) {
        EXPECT_EQ(session->owner(), tenant.name);
        listed.push_back(session->id());
      }
      after = listed.back();
    }
    return listed;
  };
  EXPECT_EQ(list_all(alice),
            std::vector<std::string>(alices.begin(), alices.end()));
  EXPECT_EQ(list_all(bob), std::vector<std::string>(bobs.begin(), bobs.end()));
  EXPECT_TRUE(manager.List("", 10, NamedTenant("carol")).empty());
}

TEST_F(SessionManagerTest, AccountingOfTenantsWithoutSessionsIsDropped) {
  SessionManager manager = MakeManager();
  const Tenant alice = NamedTenant("alice");
  auto session = manager.Create(SmallSpec(), absl::ZeroDuration(), alice);
  ASSERT_TRUE(session.ok()) << session.status();
  const TenantStats before = manager.tenant_stats("alice");
  // Owners of imports that failed (or calls that ended) leave accounting
  // nothing refers to: it must not pile up.
  for (int i = 0; i < 10000; ++i) {
    manager.UsageOf(absl::StrCat("gone-", i));
  }
  EXPECT_LE(manager.tracked_tenants(), 128);
  // Held accounting stays, and so does that of a tenant with a session.
  const std::shared_ptr<TenantUsage> held = manager.UsageOf("held");
  for (int i = 0; i < 1000; ++i) manager.UsageOf(absl::StrCat("more-", i));
  EXPECT_EQ(manager.UsageOf("held"), held);
  EXPECT_EQ(manager.tenant_stats("alice").sessions, 1);
  EXPECT_EQ(manager.tenant_stats("alice").kv_bytes, before.kv_bytes);
  ASSERT_TRUE(manager.Delete((*session)->id(), alice).ok());
  EXPECT_EQ(manager.tenant_stats("alice").sessions, 0);
}

// A session being handed over does not expire here meanwhile: the
// hand-over decides its fate (moved, or unsealed and then expired).
TEST_F(SessionManagerTest, ASealedSessionDoesNotExpire) {
  SessionManager manager = MakeManager();
  auto moved = manager.Create(SmallSpec(), absl::Seconds(10));
  auto kept = manager.Create(SmallSpec(), absl::Seconds(10));
  ASSERT_TRUE(moved.ok() && kept.ok());
  const std::string moved_id = (*moved)->id();
  const std::string kept_id = (*kept)->id();
  moved->reset();
  kept->reset();
  auto moving = manager.Seal(moved_id, absl::Now() + absl::Seconds(5));
  auto staying = manager.Seal(kept_id, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(moving.ok() && staying.ok());
  now_ += absl::Minutes(1);
  EXPECT_EQ(manager.ExpireIdle(now_), 0);
  EXPECT_EQ(manager.size(), 2);
  moving->Commit("replica-1.example:50051");
  EXPECT_EQ(MovedSessionOwner(manager.Get(moved_id).status()),
            "replica-1.example:50051");
  // Unsealed, the other one is past its idle time.
  staying = absl::UnavailableError("unsealed");
  EXPECT_EQ(manager.ExpireIdle(now_), 1);
  EXPECT_EQ(manager.size(), 0);
}

TEST_F(SessionManagerTest, ASealMakesCallsWaitAndCommitRedirectsThem) {
  SessionManager manager = MakeManager();
  const Tenant alice = NamedTenant("alice");
  const Tenant bob = NamedTenant("bob");
  auto session = manager.Create(SmallSpec(), absl::ZeroDuration(), alice);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string id = (*session)->id();
  auto seal = manager.Seal(id, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(seal.ok()) << seal.status();
  EXPECT_EQ(manager.Seal(id, absl::Now()).status().code(),
            absl::StatusCode::kFailedPrecondition);

  std::atomic<bool> done{false};
  absl::Status waited;
  std::thread call([&] {
    waited = manager.Get(id, alice).status();
    done = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(done.load());  // waits while sealed
  // Another tenant's lookups answer at once, as for an unknown id: no wait
  // tells it the id exists and is being moved.
  absl::Status bob_get, bob_delete;
  absl::Notification bob_done;
  std::thread bob_call([&] {
    bob_get = manager.Get(id, bob).status();
    bob_delete = manager.Delete(id, bob);
    bob_done.Notify();
  });
  EXPECT_TRUE(bob_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  seal->Commit("replica-1.example:50051");
  bob_call.join();
  EXPECT_EQ(bob_get.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bob_delete.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MovedSessionOwner(bob_get), std::nullopt);
  call.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MovedSessionOwner(waited), "replica-1.example:50051");
  EXPECT_NE(waited.message().find("replica-1.example:50051"),
            absl::string_view::npos);
  EXPECT_FALSE(manager.Contains(id));
  EXPECT_EQ(MovedSessionOwner(manager.Find(id, alice).status()),
            "replica-1.example:50051");
  EXPECT_EQ(MovedSessionOwner(manager.Delete(id, alice)),
            "replica-1.example:50051");
  // To another tenant the id is simply unknown.
  const absl::Status to_bob = manager.Get(id, bob).status();
  const absl::Status unknown = manager.Get("0123", bob).status();
  EXPECT_EQ(to_bob.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MovedSessionOwner(to_bob), std::nullopt);
  EXPECT_EQ(to_bob.message().find("replica-1"), absl::string_view::npos);
  EXPECT_EQ(to_bob.message().substr(to_bob.message().find("' not found")),
            unknown.message().substr(unknown.message().find("' not found")));
  EXPECT_EQ(manager.moved_sessions(), 1);
  EXPECT_EQ(manager.redirects_total(), 3);  // Get, Find, Delete: alice's
}

TEST_F(SessionManagerTest, AnUncommittedSealLetsTheWaitingCallsRun) {
  SessionManager manager = MakeManager();
  auto session = manager.Create(SmallSpec(), absl::ZeroDuration());
  ASSERT_TRUE(session.ok());
  const std::string id = (*session)->id();
  absl::Status waited = absl::UnknownError("not run");
  {
    auto sealed = manager.Seal(id, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(sealed.ok()) << sealed.status();
    std::optional<SessionSeal> seal(*std::move(sealed));
    std::thread call([&] { waited = manager.Get(id).status(); });
    absl::SleepFor(absl::Milliseconds(20));
    seal.reset();  // the move failed: unseals
    call.join();
  }
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_TRUE(manager.Contains(id));
  EXPECT_EQ(manager.moved_sessions(), 0);
}

TEST_F(SessionManagerTest, AWithdrawnCallStopsWaitingForASeal) {
  SessionManager manager = MakeManager();
  auto session = manager.Create(SmallSpec(), absl::ZeroDuration());
  ASSERT_TRUE(session.ok());
  const std::string id = (*session)->id();
  auto sealed = manager.Seal(id, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  std::optional<SessionSeal> seal(*std::move(sealed));

  // A cancelled lookup, then a fork and a delete whose deadline passes:
  // each ends while the session is still sealed, and changes nothing.
  CancellationFlag cancel;
  const CancellationFlag expire(absl::Now() + absl::Milliseconds(50));
  absl::Status get, fork, erase;
  absl::Notification done;
  std::thread calls([&] {
    get =
        manager
            .Get(id, DefaultTenant(), SessionManager::SealWait::kWait, &cancel)
            .status();
    fork = manager.Fork(id, DefaultTenant(), &expire).status();
    erase = manager.Delete(id, DefaultTenant(), &expire);
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_FALSE(done.HasBeenNotified());  // waits while sealed
  cancel.Cancel();
  const bool ended = done.WaitForNotificationWithTimeout(absl::Seconds(30));
  seal.reset();  // lets the calls end if they still wait
  calls.join();
  EXPECT_TRUE(ended) << "the withdrawn calls waited for the seal";
  EXPECT_EQ(get.code(), absl::StatusCode::kCancelled) << get;
  EXPECT_EQ(fork.code(), absl::StatusCode::kDeadlineExceeded) << fork;
  EXPECT_EQ(erase.code(), absl::StatusCode::kDeadlineExceeded) << erase;
  EXPECT_TRUE(manager.Contains(id));
  EXPECT_EQ(manager.size(), 1);
}

TEST_F(SessionManagerTest, ASealWaitsForRunningCallsButNotForHolds) {
  SessionManager manager = MakeManager();
  auto session = manager.Create(SmallSpec(), absl::ZeroDuration());
  ASSERT_TRUE(session.ok());
  const std::string id = (*session)->id();
  auto ref = manager.Get(id);
  ASSERT_TRUE(ref.ok());
  // A call runs: the seal times out and undoes itself.
  EXPECT_EQ(
      manager.Seal(id, absl::Now() + absl::Milliseconds(20)).status().code(),
      absl::StatusCode::kUnavailable);
  // A Decode stream's hold between steps does not keep the seal waiting.
  SessionHold hold(ref->shared(), manager.clock());
  *ref = SessionRef();
  auto seal = manager.Seal(id, absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(seal.ok()) << seal.status();
  EXPECT_EQ(manager.Seal("unknown", absl::Now()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(MovedSessionsTest, KeepsTheNewestTombstonesOnly) {
  MovedSessions moved(2);
  moved.Add("a", "t", "x:1");
  moved.Add("b", "t", "x:2");
  moved.Add("c", "u", "x:3");
  EXPECT_EQ(moved.size(), 2);
  EXPECT_EQ(moved.OwnerOf("a", "t"), std::nullopt);
  EXPECT_EQ(moved.OwnerOf("b", "t"), "x:2");
  EXPECT_EQ(moved.OwnerOf("c", "t"), std::nullopt);  // another tenant's
  EXPECT_EQ(moved.OwnerOf("c", "u"), "x:3");
}

TEST(MovedSessionsTest, APrefixKeepsTheRedirect) {
  const absl::Status moved = SessionMovedError("id", "x:1");
  const absl::Status prefixed = PrefixStatus("step 2: ", moved);
  EXPECT_EQ(prefixed.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(prefixed.message().substr(0, 8), "step 2: ");
  EXPECT_EQ(MovedSessionOwner(prefixed), "x:1");
  EXPECT_EQ(MovedSessionOwner(absl::NotFoundError("plain")), std::nullopt);
}

}  // namespace
}  // namespace attention

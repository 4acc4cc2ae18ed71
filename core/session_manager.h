// SessionManager: the table of live sessions, their ids and idle expiry.
#ifndef ATTENTION_CORE_SESSION_MANAGER_H_
#define ATTENTION_CORE_SESSION_MANAGER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/block_pool.h"
#include "core/call_control.h"
#include "core/change_gate.h"
#include "core/moved_sessions.h"
#include "core/session.h"
#include "core/session_spec.h"
#include "core/tenant.h"
#include "core/tenant_usage.h"

namespace attention {

struct SessionManagerOptions {
  SpecLimits limits;
  absl::Duration default_idle_timeout = absl::Minutes(10);
  absl::Duration max_idle_timeout = absl::Hours(24);
  int64_t max_sessions = 65536;
  // Bound on the sum of every live session's Session::metadata_bytes():
  // together with max_sessions it bounds the host memory sessions take
  // beyond their KV blocks.
  int64_t max_metadata_bytes = int64_t{256} << 20;
  // How often the reaper looks for expired sessions; zero disables the
  // background reaper (tests call ExpireIdle themselves).
  absl::Duration reap_interval = absl::Seconds(1);
  // Clock, replaceable by tests.
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

class SessionManager;

// A session sealed for a move to another replica (SessionManager::Seal):
// while the seal lives, calls on the session wait (Get, Delete and what uses
// them; a Get with SealWait::kFail answers SessionMovingError at once). Commit
// ends the move: the session is removed here and remembered as moved, so the
// waiting calls and later ones get the redirect (SessionMovedError). Destroying
// an uncommitted seal unseals the session: it stays here as if nothing had
// happened (the waiting calls run). Move-only; the manager must outlive it.
class SessionSeal {
 public:
  SessionSeal(SessionSeal&& other) noexcept
      : manager_(other.manager_), session_(std::move(other.session_)) {
    other.manager_ = nullptr;
  }
  SessionSeal& operator=(SessionSeal&&) = delete;
  ~SessionSeal();

  // The sealed session: no call runs on it, so its state is at rest.
  Session& session() const { return *session_; }
  // Removes the session and records that it now lives at `new_owner`.
  void Commit(const std::string& new_owner);

 private:
  friend class SessionManager;
  SessionSeal(SessionManager* manager, std::shared_ptr<Session> session)
      : manager_(manager), session_(std::move(session)) {}

  SessionManager* manager_;  // null once committed or moved from
  std::shared_ptr<Session> session_;
};

// Session metadata set aside (SessionManager::ReserveMetadata) for a session
// being built, e.g. the block tables an import fills before its session is
// adopted, so that it counts against max_metadata_bytes meanwhile. Given
// back when destroyed, unless SessionManager::Adopt took it over.
// Move-only; the manager must outlive it.
class MetadataReservation {
 public:
  MetadataReservation(MetadataReservation&& other) noexcept
      : manager_(other.manager_), bytes_(other.bytes_) {
    other.manager_ = nullptr;
  }
  MetadataReservation& operator=(MetadataReservation&&) = delete;
  ~MetadataReservation();

 private:
  friend class SessionManager;
  MetadataReservation(SessionManager* manager, int64_t bytes)
      : manager_(manager), bytes_(bytes) {}

  SessionManager* manager_;  // null once taken over or moved from
  int64_t bytes_;
};

// A kept session id an import holds while it runs (SessionManager::
// ClaimImportId): another import of the id waits until it is given back.
// Given back when destroyed. Move-only; the manager must outlive it.
class ImportIdClaim {
 public:
  ImportIdClaim(ImportIdClaim&& other) noexcept
      : manager_(other.manager_), id_(std::move(other.id_)) {
    other.manager_ = nullptr;
  }
  ImportIdClaim& operator=(ImportIdClaim&&) = delete;
  ~ImportIdClaim();

 private:
  friend class SessionManager;
  ImportIdClaim(SessionManager* manager, std::string id)
      : manager_(manager), id_(std::move(id)) {}

  SessionManager* manager_;  // null once moved from
  std::string id_;
};

// Every session belongs to the tenant that created it: the methods taking a
// `tenant` only ever see that tenant's sessions, and answer another
// tenant's session id exactly as an unknown one (NOT_FOUND, same message),
// so that ids cannot be probed. `tenant` defaults to DefaultTenant(), which
// is what a server authenticating nobody runs everything as.
//
// A session handed over to another replica (Seal, SessionSeal::Commit)
// leaves a tombstone: its tenant's lookups of the id then fail with the
// redirect (SessionMovedError: NOT_FOUND naming the new owner); other
// tenants still get the plain NOT_FOUND. At most max_sessions tombstones are
// kept (the oldest go first).
//
// Thread-safety: all methods are thread-safe. Returned sessions stay valid
// while referenced even if deleted or expired meanwhile; their blocks are
// freed when the last reference goes.
class SessionManager {
 public:
  // `pool` must outlive the manager.
  SessionManager(BlockPool* pool, SessionManagerOptions options);
  ~SessionManager();  // stops the reaper

  SessionManager(const SessionManager&) = delete;
  SessionManager& operator=(const SessionManager&) = delete;

  // Resolves `spec` and creates an empty session with an unguessable id.
  // INVALID_ARGUMENT for a bad spec or timeout (including a per-token KV
  // size larger than one pool block); RESOURCE_EXHAUSTED at max_sessions or
  // at the tenant's quota.max_sessions. idle_timeout zero means the
  // default. The session belongs to `tenant`. `control` (may be null) is
  // checked right before the session is added: a call withdrawn by then
  // creates nothing (CANCELLED or DEADLINE_EXCEEDED).
  absl::StatusOr<std::shared_ptr<Session>> Create(
      const SessionSpec& spec, absl::Duration idle_timeout,
      const Tenant& tenant = DefaultTenant(),
      const CallControl* control = nullptr);

  // What a lookup of a session sealed for a move does (when the session is
  // the caller's): wait for the move to end (then the redirect, or the
  // session if the move failed), or answer UNAVAILABLE at once (for callers
  // that serve other sessions meanwhile, such as the decode batcher).
  enum class SealWait { kWait, kFail };

  // NOT_FOUND for an unknown or expired id, or one of another tenant (the
  // redirect for a moved one). The session is in use (it cannot expire)
  // until the returned ref goes (see SessionRef for its idle clock). While
  // the session is sealed, and when it is `tenant`'s: as `seal_wait` says;
  // a wait ends CANCELLED or DEADLINE_EXCEEDED as soon as `control` (may be
  // null) says the call was withdrawn.
  absl::StatusOr<SessionRef> Get(const std::string& id,
                                 const Tenant& tenant = DefaultTenant(),
                                 SealWait seal_wait = SealWait::kWait,
                                 const CallControl* control = nullptr);

  // The session, without using it (its idle clock keeps running): what an
  // export reads. NOT_FOUND as Get.
  absl::StatusOr<std::shared_ptr<Session>> Find(
      const std::string& id, const Tenant& tenant = DefaultTenant()) const;

  // Up to `limit` of `tenant`'s live sessions whose ids come after `after`,
  // in increasing id order ("" starts at the first). Reads only `tenant`'s
  // sessions, however many other tenants hold.
  std::vector<std::shared_ptr<Session>> List(
      const std::string& after, int64_t limit,
      const Tenant& tenant = DefaultTenant()) const;

  // As List, over every tenant's sessions (a drain snapshot).
  std::vector<std::shared_ptr<Session>> ListAllTenants(const std::string& after,
                                                       int64_t limit) const;

  // Removes the session at once. NOT_FOUND as Get; waits as Get while it
  // is sealed (a call withdrawn meanwhile stops waiting), then checks
  // `control` (may be null) again: a call withdrawn meanwhile removes
  // nothing.
  absl::Status Delete(const std::string& id,
                      const Tenant& tenant = DefaultTenant(),
                      const CallControl* control = nullptr);

  // Creates a copy-on-write fork of `id`, of the same tenant. NOT_FOUND (as
  // Get), RESOURCE_EXHAUSTED (as Create); CANCELLED or DEADLINE_EXCEEDED
  // (nothing created) when `control` (may be null) says the call was
  // withdrawn while it waited for the session (its seal, as Get, or a call
  // holding it).
  absl::StatusOr<std::shared_ptr<Session>> Fork(
      const std::string& id, const Tenant& tenant = DefaultTenant(),
      const CallControl* control = nullptr);

  // What the sessions of the tenant named `name` hold now (zeros for a
  // tenant without sessions).
  TenantStats tenant_stats(const std::string& name) const;

  // Adds a session built elsewhere (a snapshot import, whose layers report
  // to UsageOf(its owner)) under its own id, counted against `quota` (its
  // tenant's). ALREADY_EXISTS when that id is live; RESOURCE_EXHAUSTED as
  // Create. Nothing changes on error. Its metadata first takes over
  // `reservation` (made for it while it was built), which Adopt ends
  // either way.
  absl::Status Adopt(std::shared_ptr<Session> session, const TenantQuota& quota,
                     MetadataReservation reservation);
  // Sets `bytes` of session metadata aside (see MetadataReservation);
  // RESOURCE_EXHAUSTED when the sessions' metadata and other reservations
  // leave less than that of max_metadata_bytes.
  absl::StatusOr<MetadataReservation> ReserveMetadata(int64_t bytes);
  // The accounting of tenant `name`, created on first use. Accounting that
  // nothing refers to any more (no session of the tenant, no call holding
  // it) is dropped from time to time, so names of tenants without sessions
  // do not pile up.
  std::shared_ptr<TenantUsage> UsageOf(const std::string& name);
  // Tenants whose accounting is kept now: those with sessions or calls in
  // flight, and at most about as many again that had them.
  int64_t tracked_tenants() const;
  // Seals session `id`, of any tenant, for a move: from now on calls on it
  // wait (see SessionSeal), and this waits until no call runs on it (a
  // Decode stream holding it between steps does not count). NOT_FOUND for
  // an unknown or expired id, FAILED_PRECONDITION when it is sealed already,
  // UNAVAILABLE when calls still run on it at `deadline` (then it is
  // unsealed again: try later).
  absl::StatusOr<SessionSeal> Seal(const std::string& id, absl::Time deadline);
  // Tombstones held now, and lookups answered with a redirect so far.
  int64_t moved_sessions() const { return moved_.size(); }
  int64_t redirects_total() const {
    return redirects_total_.load(std::memory_order_relaxed);
  }

  // The gate every change to the sessions passes: Create, Fork, Adopt and
  // Delete here, and the engine's appends and truncates. Closed, they fail
  // with UNAVAILABLE (a server that has saved its sessions).
  ChangeGate& changes() { return changes_; }

  // Claims `id` for an import that keeps it, waiting while another import
  // holds it: of two imports of one id (a hand-over asking again after a
  // lost answer), the second then finds the first one's session or none,
  // never one still on its way in. CANCELLED or DEADLINE_EXCEEDED when
  // `control` (may be null: no bound) withdraws the call while it waits.
  absl::StatusOr<ImportIdClaim> ClaimImportId(const std::string& id,
                                              const CallControl* control);

  // Whether `id` names a live session (it may expire right after).
  bool Contains(const std::string& id) const;
  // A fresh unguessable id (128 random bits, hex).
  std::string NewSessionId();
  // The block layout of a session with the resolved `spec` in this pool.
  // INVALID_ARGUMENT when one token's K/V is larger than a block.
  absl::StatusOr<KvBlockLayout> LayoutFor(const SessionSpec& spec) const;
  const SessionManagerOptions& options() const { return options_; }

  // Removes every session idle for longer than its timeout at `now`, but
  // not a sealed one (its hand-over decides: moved, or unsealed and
  // expired later); returns how many it removed.
  int64_t ExpireIdle(absl::Time now);

  int64_t size() const;
  // Sum of the live sessions' Session::metadata_bytes().
  int64_t metadata_bytes() const;
  int64_t expired_total() const;
  int64_t created_total() const;
  absl::Time Now() const { return options_.now(); }
  // The clock session refs and holds restart idle clocks with.
  const std::function<absl::Time()>* clock() const { return &options_.now; }

 private:
  friend class SessionSeal;
  friend class MetadataReservation;
  friend class ImportIdClaim;

  // Adds `session`; `reserved` bytes of metadata already counted (a
  // reservation it takes over) are part of its metadata_bytes().
  absl::Status Insert(std::shared_ptr<Session> session,
                      const TenantQuota& quota, int64_t reserved = 0);
  void ReleaseMetadata(int64_t bytes);
  void ReleaseImportId(const std::string& id);
  // What a lookup of `id` by `tenant` that found nothing answers: the
  // redirect when `id` moved and was `tenant`'s, else plain NOT_FOUND.
  absl::Status NotFound(const std::string& id, const Tenant& tenant) const;
  // Whether `id` is sealed and `tenant`'s. Another tenant's lookup finds
  // nothing either way and never waits nor hears of the move: that would
  // tell it that the id exists and is being moved.
  bool SealedFor(const std::string& id, const Tenant& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks while SealedFor(id, tenant). CANCELLED or DEADLINE_EXCEEDED
  // (still sealed) once `control` (may be null) says the call was withdrawn.
  absl::Status AwaitUnsealed(const std::string& id, const Tenant& tenant,
                             const CallControl* control)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SessionSeal's end: unseals `session`; with `new_owner` also removes it
  // and records the move.
  void EndSeal(const std::shared_ptr<Session>& session,
               const std::string* new_owner);
  using Table = absl::btree_map<std::string, std::shared_ptr<Session>>;
  // Removes `it` from the table, moving the session to `removed` (freed
  // when its last reference goes, outside the lock); returns the next
  // iterator.
  Table::iterator Erase(Table::iterator it,
                        std::vector<std::shared_ptr<Session>>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `session` is gone for its idle timeout at `now`: past it, and
  // not sealed (a sealed session's hand-over decides its fate).
  bool IdledOut(const Session& session, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Erase of a session that IdledOut, counted in expired_total_.
  Table::iterator EraseExpired(Table::iterator it,
                               std::vector<std::shared_ptr<Session>>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReaperMain();

  BlockPool* const pool_;
  const SessionManagerOptions options_;

  mutable absl::Mutex mu_;
  // Ordered, so that ListAllTenants pages through a stable order.
  absl::btree_map<std::string, std::shared_ptr<Session>> sessions_
      ABSL_GUARDED_BY(mu_);
  // The same sessions as (owner, id), so that List reads one tenant's page
  // without scanning the others' sessions under the lock. Kept by Insert
  // and Erase, the only places that change sessions_.
  absl::btree_set<std::pair<std::string, std::string>> by_owner_
      ABSL_GUARDED_BY(mu_);
  // The accounting of tenants, by name (see UsageOf).
  absl::flat_hash_map<std::string, std::shared_ptr<TenantUsage>> tenants_
      ABSL_GUARDED_BY(mu_);
  // UsageOf drops unreferenced accounting when tenants_ reaches this size.
  static constexpr size_t kMinTenantsBeforePruning = 64;
  size_t prune_tenants_at_ ABSL_GUARDED_BY(mu_) = kMinTenantsBeforePruning;
  int64_t metadata_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expired_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t created_total_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Ids of the sessions being moved now (Seal).
  absl::flat_hash_set<std::string> sealed_ ABSL_GUARDED_BY(mu_);
  // Kept ids of the imports running now (ClaimImportId).
  absl::flat_hash_set<std::string> importing_ ABSL_GUARDED_BY(mu_);
  ChangeGate changes_;
  MovedSessions moved_;
  mutable std::atomic<int64_t> redirects_total_{0};
  std::thread reaper_;
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_MANAGER_H_

#include "core/session_manager.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/client_string.h"
#include "core/status_macros.h"

namespace attention {
namespace {

// How often a call waiting for a sealed session looks at its CallControl.
constexpr absl::Duration kSealWaitPollInterval = absl::Milliseconds(10);

absl::Status SessionNotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat(
      "session ", QuoteClientString(id),
      " not found: it was deleted, expired after its idle timeout, or never "
      "existed; create a new session"));
}

}  // namespace

SessionSeal::~SessionSeal() {
  if (manager_ != nullptr) manager_->EndSeal(session_, nullptr);
}

void SessionSeal::Commit(const std::string& new_owner) {
  if (manager_ == nullptr) return;
  manager_->EndSeal(session_, &new_owner);
  manager_ = nullptr;
}

MetadataReservation::~MetadataReservation() {
  if (manager_ != nullptr) manager_->ReleaseMetadata(bytes_);
}

SessionManager::SessionManager(BlockPool* pool, SessionManagerOptions options)
    : pool_(pool), options_(std::move(options)), moved_(options_.max_sessions) {
  if (options_.reap_interval > absl::ZeroDuration()) {
    reaper_ = std::thread([this] { ReaperMain(); });
  }
}

SessionManager::~SessionManager() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

std::string SessionManager::NewSessionId() {
  // 128 bits from the OS entropy source (getrandom / RDRAND behind
  // std::random_device on Linux), so ids cannot be guessed.
  std::random_device entropy;
  std::string bytes(16, '\0');
  for (int i = 0; i < 16; i += 4) {
    const uint32_t word = entropy();
    for (int j = 0; j < 4; ++j)
      bytes[i + j] = static_cast<char>(word >> (8 * j));
  }
  return absl::BytesToHexString(bytes);
}

std::shared_ptr<TenantUsage> SessionManager::UsageOf(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(name);
  if (it != tenants_.end()) return it->second;
  if (tenants_.size() >= prune_tenants_at_) {
    // Drop the accounting nothing refers to any more (no session, no call
    // in flight: all zeros), such as that of failed imports' owners; the
    // next use starts it again from zero. The next sweep waits until the
    // map has doubled, so sweeps cost O(1) per new name.
    absl::erase_if(tenants_, [](const auto& entry) {
      return entry.second.use_count() == 1;
    });
    prune_tenants_at_ =
        std::max<size_t>(kMinTenantsBeforePruning, 2 * tenants_.size());
  }
  std::shared_ptr<TenantUsage> usage =
      std::make_shared<TenantUsage>(name, pool_->block_bytes());
  tenants_.emplace(name, usage);
  return usage;
}

int64_t SessionManager::tracked_tenants() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(tenants_.size());
}

absl::StatusOr<KvBlockLayout> SessionManager::LayoutFor(
    const SessionSpec& resolved) const {
  KvBlockLayout layout;
  layout.dtype = resolved.kv_dtype;
  layout.num_kv_heads = resolved.num_kv_heads;
  layout.head_dim = resolved.head_dim;
  layout.value_dim = resolved.value_dim;
  layout.shared_values = resolved.kv_layout == KvLayout::kSharedLatent;
  // The largest token a layer stores: a top-k layer adds its index key.
  KvBlockLayout largest = layout;
  for (const LayerSpec& layer : resolved.layers) {
    if (layer.topk > 0) largest.index_dim = resolved.index_dim;
  }
  const int64_t token_bytes = largest.bytes_per_token();
  if (token_bytes > pool_->block_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "one token of this spec needs %d bytes of K/V per layer "
        "(num_kv_heads * (head_dim + value_dim, or head_dim alone for a "
        "shared latent), + index_dim on a top-k layer, * %d), more than "
        "one KV block (%d bytes); use fewer KV heads or start the server with "
        "--kv_block_bytes >= %d",
        token_bytes, DTypeSize(layout.dtype), pool_->block_bytes(),
        (token_bytes + 255) / 256 * 256));
  }
  // A dense layer's layout; top-k layers refit theirs (LayerLayout).
  layout.tokens_per_block = pool_->block_bytes() / layout.bytes_per_token();
  return layout;
}

absl::Status SessionManager::Adopt(std::shared_ptr<Session> session,
                                   const TenantQuota& quota,
                                   MetadataReservation reservation) {
  const absl::Status status =
      Insert(std::move(session), quota, reservation.bytes_);
  if (status.ok()) reservation.manager_ = nullptr;  // now the session's
  return status;
}

absl::StatusOr<MetadataReservation> SessionManager::ReserveMetadata(
    int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes > options_.max_metadata_bytes - metadata_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this needs ", bytes, " bytes of session metadata and the sessions' ",
        metadata_bytes_, " of the server's ", options_.max_metadata_bytes,
        " (--max_session_metadata_bytes) are in use; delete sessions, or "
        "retry once other imports are done"));
  }
  metadata_bytes_ += bytes;
  return MetadataReservation(this, bytes);
}

void SessionManager::ReleaseMetadata(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  metadata_bytes_ -= bytes;
}

ImportIdClaim::~ImportIdClaim() {
  if (manager_ != nullptr) manager_->ReleaseImportId(id_);
}

absl::StatusOr<ImportIdClaim> SessionManager::ClaimImportId(
    const std::string& id, const CallControl* control) {
  absl::MutexLock lock(&mu_);
  const auto unclaimed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !importing_.contains(id);
  };
  // The other import ends with its stream; the control bounds the wait.
  while (!unclaimed()) {
    mu_.AwaitWithTimeout(absl::Condition(&unclaimed), absl::Milliseconds(50));
    if (!unclaimed()) ATTN_RETURN_IF_ERROR(CheckCall(control));
  }
  importing_.insert(id);
  return ImportIdClaim(this, id);
}

void SessionManager::ReleaseImportId(const std::string& id) {
  absl::MutexLock lock(&mu_);
  importing_.erase(id);
}

bool SessionManager::Contains(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  return it != sessions_.end() && !IdledOut(*it->second, options_.now());
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Create(
    const SessionSpec& spec, absl::Duration idle_timeout, const Tenant& tenant,
    const CallControl* control) {
  ATTN_ASSIGN_OR_RETURN(SessionSpec resolved,
                        ResolveSessionSpec(spec, options_.limits));
  if (idle_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("idle_timeout_seconds must be >= 0");
  }
  if (idle_timeout == absl::ZeroDuration()) {
    idle_timeout = options_.default_idle_timeout;
  }
  if (idle_timeout > options_.max_idle_timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "idle_timeout_seconds ", absl::ToInt64Seconds(idle_timeout),
        " exceeds the server maximum of ",
        absl::ToInt64Seconds(options_.max_idle_timeout)));
  }
  ATTN_ASSIGN_OR_RETURN(const KvBlockLayout layout, LayoutFor(resolved));
  auto session = std::make_shared<Session>(
      NewSessionId(), std::move(resolved), layout, pool_, idle_timeout,
      options_.now(), UsageOf(tenant.name));
  ATTN_RETURN_IF_ERROR(CheckCall(control));
  ATTN_RETURN_IF_ERROR(Insert(session, tenant.quota));
  return session;
}

absl::Status SessionManager::Insert(std::shared_ptr<Session> session,
                                    const TenantQuota& quota,
                                    int64_t reserved) {
  ATTN_ASSIGN_OR_RETURN(const ChangeGate::Pass pass, changes_.Enter());
  std::vector<std::shared_ptr<Session>> expired;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  if (auto it = sessions_.find(session->id());
      it != sessions_.end() && IdledOut(*it->second, options_.now())) {
    // Gone for every caller already; the reaper had not got to it.
    EraseExpired(it, &expired);
  }
  if (sessions_.contains(session->id())) {
    return absl::AlreadyExistsError(absl::StrCat(
        "a session with id ", QuoteClientString(session->id()),
        " already exists on this server; import without keep_session_id to "
        "get a new id, or delete the existing session first"));
  }
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server holds its maximum of ", options_.max_sessions,
        " sessions (--max_sessions); delete sessions you no longer need"));
  }
  // What the session adds (less than nothing when it reserved more).
  const int64_t bytes = session->metadata_bytes() - reserved;
  if (bytes > options_.max_metadata_bytes - metadata_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this session's metadata takes ", session->metadata_bytes(),
        " bytes and the sessions' ", metadata_bytes_, " of the server's ",
        options_.max_metadata_bytes,
        " (--max_session_metadata_bytes) are in use; delete sessions, or use "
        "fewer layers or sink logits and a shorter model label"));
  }
  ATTN_RETURN_IF_ERROR(session->usage().AddSession(quota));
  metadata_bytes_ += bytes;
  ++created_total_;
  by_owner_.emplace(session->owner(), session->id());
  sessions_.emplace(session->id(), std::move(session));
  return absl::OkStatus();
}

SessionManager::Table::iterator SessionManager::Erase(
    Table::iterator it, std::vector<std::shared_ptr<Session>>* removed) {
  metadata_bytes_ -= it->second->metadata_bytes();
  it->second->usage().RemoveSession();
  by_owner_.erase({it->second->owner(), it->first});
  removed->push_back(std::move(it->second));
  return sessions_.erase(it);
}

bool SessionManager::IdledOut(const Session& session, absl::Time now) const {
  return session.Expired(now) && !sealed_.contains(session.id());
}

SessionManager::Table::iterator SessionManager::EraseExpired(
    Table::iterator it, std::vector<std::shared_ptr<Session>>* removed) {
  ++expired_total_;
  return Erase(it, removed);
}

absl::StatusOr<SessionRef> SessionManager::Get(const std::string& id,
                                               const Tenant& tenant,
                                               SealWait seal_wait,
                                               const CallControl* control) {
  const absl::Time now = options_.now();
  std::vector<std::shared_ptr<Session>> expired;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  if (seal_wait == SealWait::kWait) {
    ATTN_RETURN_IF_ERROR(AwaitUnsealed(id, tenant, control));
  } else if (SealedFor(id, tenant)) {
    return SessionMovingError(id);
  }
  auto it = sessions_.find(id);
  // Another tenant's session is answered exactly as a missing one.
  if (it == sessions_.end() || it->second->owner() != tenant.name) {
    return NotFound(id, tenant);
  }
  if (IdledOut(*it->second, now)) {
    EraseExpired(it, &expired);
    return SessionNotFound(id);
  }
  // Taken under the lock, so the reaper cannot expire it in between. The
  // idle clock restarts when the call ends, if it succeeded (SessionRef).
  return SessionRef(it->second, &options_.now);
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(
    const std::string& id, const Tenant& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  // Another tenant's session is answered exactly as a missing one.
  if (it == sessions_.end() || it->second->owner() != tenant.name) {
    return NotFound(id, tenant);
  }
  if (IdledOut(*it->second, options_.now())) return SessionNotFound(id);
  return it->second;
}

std::vector<std::shared_ptr<Session>> SessionManager::List(
    const std::string& after, int64_t limit, const Tenant& tenant) const {
  const absl::Time now = options_.now();
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> sessions;
  for (auto it = by_owner_.upper_bound({tenant.name, after});
       it != by_owner_.end() && it->first == tenant.name &&
       static_cast<int64_t>(sessions.size()) < limit;
       ++it) {
    auto session = sessions_.find(it->second);
    if (session != sessions_.end() && !IdledOut(*session->second, now)) {
      sessions.push_back(session->second);
    }
  }
  return sessions;
}

std::vector<std::shared_ptr<Session>> SessionManager::ListAllTenants(
    const std::string& after, int64_t limit) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> sessions;
  for (auto it = sessions_.upper_bound(after);
       it != sessions_.end() && static_cast<int64_t>(sessions.size()) < limit;
       ++it) {
    sessions.push_back(it->second);
  }
  return sessions;
}

absl::Status SessionManager::Delete(const std::string& id, const Tenant& tenant,
                                    const CallControl* control) {
  ATTN_ASSIGN_OR_RETURN(const ChangeGate::Pass pass, changes_.Enter());
  std::vector<std::shared_ptr<Session>> removed;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  ATTN_RETURN_IF_ERROR(AwaitUnsealed(id, tenant, control));
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->owner() != tenant.name) {
    return NotFound(id, tenant);
  }
  if (IdledOut(*it->second, options_.now())) {
    EraseExpired(it, &removed);
    return SessionNotFound(id);
  }
  ATTN_RETURN_IF_ERROR(CheckCall(control));
  Erase(it, &removed);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Fork(
    const std::string& id, const Tenant& tenant, const CallControl* control) {
  ATTN_ASSIGN_OR_RETURN(SessionRef parent,
                        Get(id, tenant, SealWait::kWait, control));
  std::shared_ptr<Session> child;
  {
    absl::MutexLock lock(&parent->mu());
    child = parent->Fork(NewSessionId(), options_.now());
  }
  // The fork exists once inserted: a call withdrawn while it waited for
  // the parent (an append holding it) creates nothing.
  ATTN_RETURN_IF_ERROR(CheckCall(control));
  ATTN_RETURN_IF_ERROR(Insert(child, tenant.quota));
  parent.MarkUsed();
  return child;
}

TenantStats SessionManager::tenant_stats(const std::string& name) const {
  std::shared_ptr<TenantUsage> usage;
  {
    absl::MutexLock lock(&mu_);
    auto it = tenants_.find(name);
    if (it == tenants_.end()) return TenantStats{};
    usage = it->second;
  }
  return usage->stats();
}

absl::Status SessionManager::NotFound(const std::string& id,
                                      const Tenant& tenant) const {
  if (std::optional<std::string> owner = moved_.OwnerOf(id, tenant.name)) {
    redirects_total_.fetch_add(1, std::memory_order_relaxed);
    return SessionMovedError(id, *owner);
  }
  return SessionNotFound(id);
}

bool SessionManager::SealedFor(const std::string& id,
                               const Tenant& tenant) const {
  if (!sealed_.contains(id)) return false;
  auto it = sessions_.find(id);
  return it != sessions_.end() && it->second->owner() == tenant.name;
}

absl::Status SessionManager::AwaitUnsealed(const std::string& id,
                                           const Tenant& tenant,
                                           const CallControl* control) {
  if (!SealedFor(id, tenant)) return absl::OkStatus();
  const auto unsealed = [this, &id]() {
    mu_.AssertHeld();
    return !sealed_.contains(id);
  };
  if (control == nullptr) {
    mu_.Await(absl::Condition(&unsealed));
    return absl::OkStatus();
  }
  // A move can last the whole drain; a caller that gave up stops waiting
  // (CallControl has no wake-up of its own, so the wait looks at it now
  // and then).
  while (!mu_.AwaitWithTimeout(absl::Condition(&unsealed),
                               kSealWaitPollInterval)) {
    ATTN_RETURN_IF_ERROR(control->Check());
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionSeal> SessionManager::Seal(const std::string& id,
                                                 absl::Time deadline) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end() || IdledOut(*it->second, options_.now())) {
      return SessionNotFound(id);
    }
    if (!sealed_.insert(id).second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session ", QuoteClientString(id), " is being moved already"));
    }
    session = it->second;
  }
  // From here on no new call starts on it; wait for the running ones.
  SessionSeal seal(this, session);
  while (session->calls() > 0) {
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(
          "session ", QuoteClientString(id),
          " still had calls running when its seal timed out; try again"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return seal;
}

void SessionManager::EndSeal(const std::shared_ptr<Session>& session,
                             const std::string* new_owner) {
  std::vector<std::shared_ptr<Session>> removed;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  sealed_.erase(session->id());
  if (new_owner == nullptr) return;
  // Recorded before the waiting calls can look again (same lock).
  moved_.Add(session->id(), session->owner(), *new_owner);
  auto it = sessions_.find(session->id());
  if (it != sessions_.end() && it->second == session) Erase(it, &removed);
}

int64_t SessionManager::ExpireIdle(absl::Time now) {
  std::vector<std::shared_ptr<Session>> expired;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    it =
        IdledOut(*it->second, now) ? EraseExpired(it, &expired) : std::next(it);
  }
  return static_cast<int64_t>(expired.size());
}

int64_t SessionManager::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(sessions_.size());
}

int64_t SessionManager::metadata_bytes() const {
  absl::MutexLock lock(&mu_);
  return metadata_bytes_;
}

int64_t SessionManager::expired_total() const {
  absl::MutexLock lock(&mu_);
  return expired_total_;
}

int64_t SessionManager::created_total() const {
  absl::MutexLock lock(&mu_);
  return created_total_;
}

void SessionManager::ReaperMain() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.reap_interval);
      if (stopping_) return;
    }
    ExpireIdle(options_.now());
  }
}

}  // namespace attention

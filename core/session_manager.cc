#include "core/session_manager.h"

#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/client_string.h"
#include "core/status_macros.h"

namespace attention {
namespace {

absl::Status SessionNotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat(
      "session ", QuoteClientString(id),
      " not found: it was deleted, expired after its idle timeout, or never "
      "existed; create a new session"));
}

}  // namespace

SessionManager::SessionManager(BlockPool* pool, SessionManagerOptions options)
    : pool_(pool), options_(std::move(options)) {
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
  std::shared_ptr<TenantUsage>& usage = tenants_[name];
  if (usage == nullptr) {
    usage = std::make_shared<TenantUsage>(name, pool_->block_bytes());
  }
  return usage;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Create(
    const SessionSpec& spec, absl::Duration idle_timeout,
    const Tenant& tenant) {
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
  KvBlockLayout layout;
  layout.dtype = resolved.kv_dtype;
  layout.num_kv_heads = resolved.num_kv_heads;
  layout.head_dim = resolved.head_dim;
  layout.value_dim = resolved.value_dim;
  const int64_t token_bytes = layout.bytes_per_token();
  if (token_bytes > pool_->block_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "one token of this spec needs %d bytes of K/V per layer "
        "(num_kv_heads * (head_dim + value_dim) * %d), more than one KV block "
        "(%d bytes); use fewer KV heads or start the server with "
        "--kv_block_bytes >= %d",
        token_bytes, DTypeSize(layout.dtype), pool_->block_bytes(),
        (token_bytes + 255) / 256 * 256));
  }
  layout.tokens_per_block = pool_->block_bytes() / token_bytes;
  auto session = std::make_shared<Session>(
      NewSessionId(), std::move(resolved), layout, pool_, idle_timeout,
      options_.now(), UsageOf(tenant.name));
  ATTN_RETURN_IF_ERROR(Insert(session, tenant.quota));
  return session;
}

absl::Status SessionManager::Insert(std::shared_ptr<Session> session,
                                    const TenantQuota& quota) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server holds its maximum of ", options_.max_sessions,
        " sessions (--max_sessions); delete sessions you no longer need"));
  }
  const int64_t bytes = session->metadata_bytes();
  if (bytes > options_.max_metadata_bytes - metadata_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this session's metadata takes ", bytes, " bytes and the sessions' ",
        metadata_bytes_, " of the server's ", options_.max_metadata_bytes,
        " (--max_session_metadata_bytes) are in use; delete sessions, or use "
        "fewer layers or sink logits and a shorter model label"));
  }
  ATTN_RETURN_IF_ERROR(session->usage().AddSession(quota));
  metadata_bytes_ += bytes;
  ++created_total_;
  sessions_.emplace(session->id(), std::move(session));
  return absl::OkStatus();
}

SessionManager::Table::iterator SessionManager::Erase(
    Table::iterator it, std::vector<std::shared_ptr<Session>>* removed) {
  metadata_bytes_ -= it->second->metadata_bytes();
  it->second->usage().RemoveSession();
  removed->push_back(std::move(it->second));
  return sessions_.erase(it);
}

absl::StatusOr<SessionRef> SessionManager::Get(const std::string& id,
                                               const Tenant& tenant) {
  const absl::Time now = options_.now();
  std::vector<std::shared_ptr<Session>> expired;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  // Another tenant's session is answered exactly as a missing one.
  if (it == sessions_.end() || it->second->owner() != tenant.name) {
    return SessionNotFound(id);
  }
  if (it->second->Expired(now)) {
    Erase(it, &expired);
    ++expired_total_;
    return SessionNotFound(id);
  }
  it->second->Touch(now);
  // Taken under the lock, so the reaper cannot expire it in between.
  return SessionRef(it->second, &options_.now);
}

std::vector<std::shared_ptr<Session>> SessionManager::List(
    const std::string& after, int64_t limit, const Tenant& tenant) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> sessions;
  for (auto it = sessions_.upper_bound(after);
       it != sessions_.end() && static_cast<int64_t>(sessions.size()) < limit;
       ++it) {
    if (it->second->owner() == tenant.name) sessions.push_back(it->second);
  }
  return sessions;
}

absl::Status SessionManager::Delete(const std::string& id,
                                    const Tenant& tenant) {
  std::vector<std::shared_ptr<Session>> removed;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->owner() != tenant.name) {
    return SessionNotFound(id);
  }
  Erase(it, &removed);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Fork(
    const std::string& id, const Tenant& tenant) {
  ATTN_ASSIGN_OR_RETURN(SessionRef parent, Get(id, tenant));
  std::shared_ptr<Session> child;
  {
    absl::MutexLock lock(&parent->mu());
    child = parent->Fork(NewSessionId(), options_.now());
  }
  ATTN_RETURN_IF_ERROR(Insert(child, tenant.quota));
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

int64_t SessionManager::ExpireIdle(absl::Time now) {
  std::vector<std::shared_ptr<Session>> expired;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->Expired(now)) {
      it = Erase(it, &expired);
    } else {
      ++it;
    }
  }
  expired_total_ += static_cast<int64_t>(expired.size());
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

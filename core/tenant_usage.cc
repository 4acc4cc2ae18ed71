#include "core/tenant_usage.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/client_string.h"
#include "core/try_first_mutex_lock.h"

namespace attention {

TenantUsage::TenantUsage(std::string name, int64_t block_bytes)
    : name_(std::move(name)), block_bytes_(block_bytes) {}

absl::Status TenantUsage::AddSession(const TenantQuota& quota) {
  TryFirstMutexLock lock(&mu_);
  if (quota.max_sessions.has_value() && sessions_ >= *quota.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", QuoteClientString(name_), " holds ", sessions_,
        " sessions, its quota max_sessions is ", *quota.max_sessions,
        "; delete sessions you no longer need or ask for a larger quota"));
  }
  ++sessions_;
  return absl::OkStatus();
}

void TenantUsage::RemoveSession() {
  TryFirstMutexLock lock(&mu_);
  --sessions_;
}

void TenantUsage::Ref(BlockId id) {
  TryFirstMutexLock lock(&mu_);
  ++refs_[id];
}

void TenantUsage::Unref(BlockId id) {
  TryFirstMutexLock lock(&mu_);
  auto it = refs_.find(id);
  if (--it->second == 0) refs_.erase(it);
}

void TenantUsage::RefAll(absl::Span<const BlockId> ids) {
  TryFirstMutexLock lock(&mu_);
  for (BlockId id : ids) {
    if (id != kNoBlock) ++refs_[id];
  }
}

int64_t TenantUsage::RefReserved(absl::Span<const BlockId> ids) {
  TryFirstMutexLock lock(&mu_);
  int64_t taken = 0;
  for (BlockId id : ids) {
    if (id == kNoBlock) continue;
    ++refs_[id];
    ++taken;
  }
  reserved_blocks_ -= taken;
  return taken;
}

void TenantUsage::UnrefAll(absl::Span<const BlockId> ids) {
  TryFirstMutexLock lock(&mu_);
  for (BlockId id : ids) {
    if (id == kNoBlock) continue;
    auto it = refs_.find(id);
    if (--it->second == 0) refs_.erase(it);
  }
}

absl::Status TenantUsage::Reserve(int64_t blocks, const TenantQuota& quota) {
  TryFirstMutexLock lock(&mu_);
  // A call that needs no new block passes even when the tenant is over a
  // quota lowered since it took its blocks: it adds nothing.
  if (quota.max_kv_bytes.has_value() && blocks > 0) {
    const int64_t used =
        (static_cast<int64_t>(refs_.size()) + reserved_blocks_) * block_bytes_;
    const int64_t needed = blocks * block_bytes_;
    if (needed > *quota.max_kv_bytes - used) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant ", QuoteClientString(name_), " uses ", used,
          " bytes of KV cache and this call needs ", needed,
          " more, over its quota max_kv_bytes of ", *quota.max_kv_bytes,
          "; delete or truncate sessions, or ask for a larger quota"));
    }
  }
  reserved_blocks_ += blocks;
  return absl::OkStatus();
}

void TenantUsage::Unreserve(int64_t blocks) {
  TryFirstMutexLock lock(&mu_);
  reserved_blocks_ -= blocks;
}

TenantStats TenantUsage::stats() const {
  TryFirstMutexLock lock(&mu_);
  return TenantStats{
      .sessions = sessions_,
      .kv_bytes = static_cast<int64_t>(refs_.size()) * block_bytes_};
}

}  // namespace attention

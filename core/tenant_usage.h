// TenantUsage: what one tenant's sessions hold — how many sessions, and
// which KV blocks they reference (a block shared by several of the tenant's
// sessions, e.g. forks of one prompt, counts once) — and the reservations
// of appends in flight, checked against the tenant's quota.
//
// Layer caches report every block reference they gain or drop (Ref /
// Unref); an append reserves the blocks it is about to take before taking
// any (Reserve), so that concurrent appends of one tenant cannot together
// pass its max_kv_bytes.
#ifndef ATTENTION_CORE_TENANT_USAGE_H_
#define ATTENTION_CORE_TENANT_USAGE_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/block_pool.h"
#include "core/tenant.h"

namespace attention {

// A tenant's usage at one moment.
struct TenantStats {
  int64_t sessions = 0;
  // Distinct KV blocks referenced by the tenant's sessions, in bytes.
  int64_t kv_bytes = 0;
};

// Thread-safety: all methods are thread-safe.
class TenantUsage {
 public:
  TenantUsage(std::string name, int64_t block_bytes);

  TenantUsage(const TenantUsage&) = delete;
  TenantUsage& operator=(const TenantUsage&) = delete;

  const std::string& name() const { return name_; }

  // A session of the tenant is created / goes. AddSession fails with
  // RESOURCE_EXHAUSTED (nothing counted) when the tenant already holds
  // quota.max_sessions sessions.
  absl::Status AddSession(const TenantQuota& quota);
  void RemoveSession();

  // One reference to block `id` from one of the tenant's layer caches is
  // gained / dropped. Unref REQUIRES a matching Ref.
  void Ref(BlockId id);
  void Unref(BlockId id);
  // As above for each id that is not kNoBlock.
  void RefAll(absl::Span<const BlockId> ids);
  void UnrefAll(absl::Span<const BlockId> ids);
  // RefAll(ids) and Unreserve(n) in one step, n the ids that are not
  // kNoBlock (blocks taken under a reservation): the tenant's usage never
  // counts them twice, so a concurrent Reserve is not refused for it.
  // Returns n. REQUIRES: at least n blocks reserved.
  int64_t RefReserved(absl::Span<const BlockId> ids);

  // Reserves `blocks` new blocks for an append about to take them:
  // RESOURCE_EXHAUSTED, naming the quota, the usage and the limit (nothing
  // reserved), when the tenant's blocks plus the reservations plus these
  // would pass quota.max_kv_bytes. Every successful Reserve needs a matching
  // Unreserve (after the append committed, i.e. Ref'd, its blocks, or
  // failed).
  absl::Status Reserve(int64_t blocks, const TenantQuota& quota);
  void Unreserve(int64_t blocks);

  TenantStats stats() const;

 private:
  const std::string name_;
  const int64_t block_bytes_;

  mutable absl::Mutex mu_;
  int64_t sessions_ ABSL_GUARDED_BY(mu_) = 0;
  // References from the tenant's layer caches, per block.
  absl::flat_hash_map<BlockId, int32_t> refs_ ABSL_GUARDED_BY(mu_);
  int64_t reserved_blocks_ ABSL_GUARDED_BY(mu_) = 0;
};

// Holds a TenantUsage reservation until it goes (the append committed its
// blocks or failed). Move-only.
class BlockReservation {
 public:
  BlockReservation() = default;
  // `usage` must outlive the reservation. REQUIRES: usage->Reserve(blocks)
  // succeeded.
  BlockReservation(TenantUsage* usage, int64_t blocks)
      : usage_(usage), blocks_(blocks) {}
  BlockReservation(BlockReservation&& other) noexcept
      : usage_(other.usage_), blocks_(other.blocks_) {
    other.usage_ = nullptr;
  }
  BlockReservation& operator=(BlockReservation&& other) noexcept {
    if (this != &other) {
      Release();
      usage_ = other.usage_;
      blocks_ = other.blocks_;
      other.usage_ = nullptr;
    }
    return *this;
  }
  ~BlockReservation() { Release(); }

  // The blocks `ids` (not kNoBlock) were taken under this reservation: they
  // now count as the tenant's (TenantUsage::RefReserved) and the
  // reservation holds that many fewer. REQUIRES: the reservation is not
  // empty and holds at least that many blocks.
  void Take(absl::Span<const BlockId> ids) {
    blocks_ -= usage_->RefReserved(ids);
  }
  TenantUsage* usage() const { return usage_; }

 private:
  void Release() {
    if (usage_ != nullptr) usage_->Unreserve(blocks_);
    usage_ = nullptr;
  }

  TenantUsage* usage_ = nullptr;
  int64_t blocks_ = 0;
};

}  // namespace attention

#endif  // ATTENTION_CORE_TENANT_USAGE_H_

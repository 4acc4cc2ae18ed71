// SessionImport: a session being restored from a snapshot
// (core/session_snapshot.h), staged until its trailer has been checked.
//
// Begin validates the header completely, checks the owning tenant's quotas
// and takes every KV block the session needs up front (RESOURCE_EXHAUSTED
// before any data when the pool or the tenant's max_kv_bytes cannot hold
// it, or the tenant is at max_sessions); AddChunk validates each data chunk
// (order, sizes, finiteness) and writes it into the staged blocks; Finish
// checks that every carried row arrived and that the checksum matches, and only
// then adds the session to the server. Like LayerKvCache::PendingAppend, the
// destructor is the rollback: dropping an unfinished import returns its
// blocks, so a failed import leaves no session, block or byte behind.
//
// Errors: INVALID_ARGUMENT for a record that is malformed, out of order or
// inconsistent with the header (or a spec this server does not accept);
// DATA_LOSS for a missing record or a checksum mismatch; ALREADY_EXISTS for
// a kept id that is live; RESOURCE_EXHAUSTED for the KV pool, the session
// limits or the tenant's quotas; CANCELLED or DEADLINE_EXCEEDED when
// ImportOptions::control withdraws the call while Begin waits (below).
//
// Imports that keep one id run one at a time: Begin waits while another
// import of that id runs (until it is finished or dropped), then answers
// ALREADY_EXISTS if that one created the session.
//
// Thread-safety: not thread-safe (one writer). Must be destroyed before the
// engine it came from.
#ifndef ATTENTION_CORE_SESSION_IMPORT_H_
#define ATTENTION_CORE_SESSION_IMPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/backend.h"
#include "core/block_pool.h"
#include "core/call_control.h"
#include "core/layer_kv_cache.h"
#include "core/session.h"
#include "core/session_manager.h"
#include "core/session_snapshot.h"
#include "core/tenant.h"
#include "core/tenant_usage.h"

namespace attention {

struct ImportOptions {
  // Keep the snapshot's session id (ALREADY_EXISTS when it is live)
  // instead of a new one.
  bool keep_session_id = false;
  // Keep the snapshot's idle deadline (a restore at start-up) instead of
  // restarting the idle clock (ImportSession).
  bool keep_idle_deadline = false;
  // The tenant the session will belong to (ImportSession: the caller), whose
  // quotas (max_sessions, max_kv_bytes) the import is checked against.
  Tenant tenant = DefaultTenant();
  // Give the session back to the snapshot's owner (a restore at start-up)
  // instead of `tenant`; `owner_quota` then gives that tenant's quota
  // (unset: none). A snapshot without an owner restores to the default
  // tenant.
  bool keep_owner = false;
  std::function<TenantQuota(const std::string& owner)> owner_quota;
  // Optional: withdraws the call while Begin waits for another import of
  // the same kept id (SessionManager::ClaimImportId). Must outlive Begin.
  // Without one Begin waits as long as that import lives: never begin a
  // second import of an id while holding the first.
  const CallControl* control = nullptr;
};

class SessionImport {
 public:
  // Validates `header` and stages the session's blocks. `manager`, `pool`
  // and `backend` must outlive the import.
  static absl::StatusOr<std::unique_ptr<SessionImport>> Begin(
      SessionManager* manager, BlockPool* pool, AttentionBackend* backend,
      const SnapshotHeader& header, const ImportOptions& options);

  SessionImport(const SessionImport&) = delete;
  SessionImport& operator=(const SessionImport&) = delete;
  ~SessionImport() = default;  // unfinished: returns every staged block

  // Validates the next data chunk and writes its rows.
  absl::Status AddChunk(const SnapshotChunk& chunk);

  // Checks that the snapshot is complete and intact and adds the session.
  // After an error the import is unusable (drop it).
  absl::StatusOr<SessionInfo> Finish(const SnapshotTrailer& trailer);

  // Rows still expected (all layers).
  int64_t remaining_tokens() const { return remaining_tokens_; }

 private:
  SessionImport(SessionManager* manager, BlockPool* pool,
                AttentionBackend* backend, SnapshotHeader header,
                KvBlockLayout layout, std::string id,
                absl::Duration idle_timeout, absl::Time last_used,
                Tenant tenant, std::shared_ptr<TenantUsage> usage,
                MetadataReservation metadata, std::vector<LayerKvCache> layers,
                std::optional<ImportIdClaim> id_claim);
  // Moves the cursor to the next carried row (SeekCarriedRow).
  void Advance();

  // A kept id's claim, until the session is added or the import dropped.
  // First, so that a drop gives it back last, after the staged blocks.
  std::optional<ImportIdClaim> id_claim_;
  SessionManager* const manager_;
  BlockPool* const pool_;
  AttentionBackend* const backend_;
  const SnapshotHeader header_;
  const KvBlockLayout layout_;
  const std::string id_;
  const absl::Duration idle_timeout_;
  const absl::Time last_used_;
  const Tenant tenant_;
  // The owner's accounting; before the layers, which report to it.
  const std::shared_ptr<TenantUsage> usage_;
  // What the staged tables take, until the session takes it over.
  MetadataReservation metadata_;
  std::vector<LayerKvCache> layers_;  // staged; freed unless finished
  std::vector<LayerKvCache::ListedBlocks> blocks_;
  SnapshotChecksum checksum_;
  int64_t num_chunks_ = 0;
  int64_t remaining_tokens_ = 0;
  // The next row expected, and the end of its carried range.
  int layer_ = 0;
  int64_t position_ = 0;
  int64_t range_end_ = 0;
  bool finished_ = false;
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_IMPORT_H_

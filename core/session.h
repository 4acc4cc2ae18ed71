// Session: the per-layer KV caches of one client sequence.
#ifndef ATTENTION_CORE_SESSION_H_
#define ATTENTION_CORE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/block_pool.h"
#include "core/layer_kv_cache.h"
#include "core/session_spec.h"
#include "core/tenant_usage.h"

namespace attention {

// A snapshot of a session's state (attention.v1.SessionInfo).
struct SessionInfo {
  std::string session_id;
  // The owning tenant's name (not part of the proto message).
  std::string owner;
  SessionSpec spec;
  std::vector<int64_t> layer_lengths;
  int64_t kv_cache_bytes = 0;
  // Host memory the session's metadata takes (Session::metadata_bytes()).
  int64_t metadata_bytes = 0;
};

// Session::metadata_bytes() of a session with the resolved `spec`.
int64_t SessionMetadataBytes(const SessionSpec& spec);

// The block layout of `layer` of `spec`: `dense` (the session's layout)
// for a dense layer; for a top-k layer (topk > 0) the same plus index keys
// of spec.index_dim, with tokens_per_block refitted to `block_bytes`.
KvBlockLayout LayerLayout(const SessionSpec& spec, const LayerSpec& layer,
                          const KvBlockLayout& dense, int64_t block_bytes);

// Thread-safety: id(), spec(), layout() and the idle clock are safe from any
// thread; the layer caches are guarded by mu().
class Session {
 public:
  // `spec` must be resolved; `pool` must outlive the session. The session
  // belongs to the tenant `usage` accounts for (not null), which is told of
  // every KV block its layers reference. `layout` is that of a dense layer;
  // a top-k layer's also holds index keys (LayerLayout).
  Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
          BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
          std::shared_ptr<TenantUsage> usage);

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  // The name of the tenant the session belongs to.
  const std::string& owner() const { return usage_->name(); }
  TenantUsage& usage() const { return *usage_; }
  const SessionSpec& spec() const { return spec_; }
  const KvBlockLayout& layout() const { return layout_; }
  absl::Duration idle_timeout() const { return idle_timeout_; }

  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }
  LayerKvCache& layer(int index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return layers_[index];
  }
  const LayerKvCache& layer(int index) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return layers_[index];
  }

  // A restored session of the tenant `usage` accounts for (not null), e.g.
  // from a snapshot: `layers` (one per layer of the resolved `spec`, from
  // LayerKvCache::Restore with the same `usage`) become its caches; its
  // idle clock starts at `last_used`. Their block tables count in its
  // metadata_bytes().
  static std::unique_ptr<Session> FromLayers(
      std::string id, SessionSpec spec, const KvBlockLayout& layout,
      BlockPool* pool, absl::Duration idle_timeout, absl::Time last_used,
      std::shared_ptr<TenantUsage> usage, std::vector<LayerKvCache> layers);

  // A new session `id` of the same tenant with the same spec and history,
  // sharing blocks.
  std::unique_ptr<Session> Fork(std::string id, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SessionInfo Info() const ABSL_LOCKS_EXCLUDED(mu_);

  // Host memory of the session's metadata: the object, its resolved spec
  // (model label, per-layer specs and sink logits) and its layer caches'
  // fixed part; for a fork also the block tables it copied (a fork shares
  // its parent's blocks, so the pool does not bound those). Block tables
  // of the session's own blocks come on top, in proportion to the KV
  // blocks the pool bounds.
  int64_t metadata_bytes() const { return metadata_bytes_; }

  // Idle clock: a session is expired when no call uses it and
  // now - last_used > idle_timeout.
  void Touch(absl::Time now);
  bool Expired(absl::Time now) const;
  // When the idle clock last restarted.
  absl::Time last_used() const;
  // A call (or an open Decode stream) uses the session from BeginUse to
  // EndUse: it never expires meanwhile. A use that succeeded (`used`)
  // restarts the idle clock at clock(), so idle time counts from the end of
  // the last successful call; a failed one changes nothing, its idle clock
  // included. Use SessionRef or SessionHold.
  void BeginUse() { users_.fetch_add(1, std::memory_order_acq_rel); }
  void EndUse(bool used, const std::function<absl::Time()>& clock);
  // Whether a call or a Decode stream uses the session now.
  bool in_use() const { return users_.load(std::memory_order_acquire) > 0; }
  // Calls running on the session now (SessionRefs; a Decode stream's
  // SessionHold is not one): a seal (SessionManager::Seal) waits for none.
  void BeginCall() { calls_.fetch_add(1, std::memory_order_acq_rel); }
  void EndCall() { calls_.fetch_sub(1, std::memory_order_acq_rel); }
  int32_t calls() const { return calls_.load(std::memory_order_acquire); }

 private:
  // `copied_table_bytes`: the block tables a fork copied (metadata_bytes).
  Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
          BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
          std::shared_ptr<TenantUsage> usage, std::vector<LayerKvCache> layers,
          int64_t copied_table_bytes = 0);

  const std::string id_;
  // Before the layers, which report to it until they go.
  const std::shared_ptr<TenantUsage> usage_;
  const SessionSpec spec_;
  const KvBlockLayout layout_;
  BlockPool* const pool_;
  const absl::Duration idle_timeout_;
  const int64_t metadata_bytes_;
  std::atomic<int64_t> last_used_ns_;  // absl::ToUnixNanos
  std::atomic<int32_t> users_{0};
  std::atomic<int32_t> calls_{0};

  mutable absl::Mutex mu_;
  std::vector<LayerKvCache> layers_ ABSL_GUARDED_BY(mu_);
};

// A session held by one call: while any SessionRef to a session lives, the
// session does not expire (Session::BeginUse) and counts a call
// (Session::BeginCall). A ref whose call succeeded (MarkUsed) restarts the
// session's idle clock when it goes; one whose call failed leaves the clock
// as it was. Move-only.
class SessionRef {
 public:
  SessionRef() = default;
  // `clock` must outlive the ref.
  SessionRef(std::shared_ptr<Session> session,
             const std::function<absl::Time()>* clock)
      : session_(std::move(session)), clock_(clock) {
    session_->BeginUse();
    session_->BeginCall();
  }
  SessionRef(SessionRef&& other) = default;
  SessionRef& operator=(SessionRef&& other) {
    Release();
    session_ = std::move(other.session_);
    clock_ = other.clock_;
    used_ = other.used_;
    return *this;
  }
  ~SessionRef() { Release(); }

  // Another ref to the same session, made without a lookup (which could
  // wait for a seal that waits for this ref's call); it is not marked used.
  // REQUIRES: *this.
  SessionRef Share() const { return SessionRef(session_, clock_); }

  // The call succeeded: releasing the ref restarts the idle clock.
  void MarkUsed() { used_ = true; }

  Session* get() const { return session_.get(); }
  Session* operator->() const { return session_.get(); }
  Session& operator*() const { return *session_; }
  explicit operator bool() const { return session_ != nullptr; }
  const std::shared_ptr<Session>& shared() const { return session_; }

 private:
  void Release() {
    if (session_ != nullptr) {
      session_->EndCall();
      session_->EndUse(used_, *clock_);
    }
    session_.reset();
    used_ = false;
  }

  std::shared_ptr<Session> session_;
  const std::function<absl::Time()>* clock_ = nullptr;
  bool used_ = false;
};

// Keeps a session in use (it cannot expire) without keeping it alive: a
// session deleted while held is freed at once. What a Decode stream holds
// for every session it has used. As a SessionRef, it restarts the idle
// clock when it goes only if marked used (a step on the session
// succeeded). Move-only.
class SessionHold {
 public:
  // `clock` must outlive the hold.
  SessionHold(const std::shared_ptr<Session>& session,
              const std::function<absl::Time()>* clock)
      : session_(session), clock_(clock) {
    session->BeginUse();
  }
  SessionHold(SessionHold&& other) noexcept
      : session_(std::move(other.session_)),
        clock_(other.clock_),
        used_(other.used_) {
    other.session_.reset();
  }
  SessionHold& operator=(SessionHold&&) = delete;
  ~SessionHold() {
    if (std::shared_ptr<Session> session = session_.lock()) {
      session->EndUse(used_, *clock_);
    }
  }

  void MarkUsed() { used_ = true; }
  // Whether the held session is gone (deleted, moved or expired and
  // freed): a session made since under the same id is another one.
  bool lost() const { return session_.expired(); }

 private:
  std::weak_ptr<Session> session_;
  const std::function<absl::Time()>* clock_;
  bool used_ = false;
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_H_

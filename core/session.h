// Session: the per-layer KV caches of one client sequence.
#ifndef ATTENTION_CORE_SESSION_H_
#define ATTENTION_CORE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/block_pool.h"
#include "core/layer_kv_cache.h"
#include "core/session_spec.h"

namespace attention {

// A snapshot of a session's state (attention.v1.SessionInfo).
struct SessionInfo {
  std::string session_id;
  SessionSpec spec;
  std::vector<int64_t> layer_lengths;
  int64_t kv_cache_bytes = 0;
};

// Thread-safety: id(), spec(), layout() and the idle clock are safe from any
// thread; the layer caches are guarded by mu().
class Session {
 public:
  // `spec` must be resolved; `pool` must outlive the session.
  Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
          BlockPool* pool, absl::Duration idle_timeout, absl::Time now);

  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
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

  // A new session `id` with the same spec and history, sharing blocks.
  std::unique_ptr<Session> Fork(std::string id, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SessionInfo Info() const ABSL_LOCKS_EXCLUDED(mu_);

  // Idle clock: a session is expired when now - last_used > idle_timeout.
  void Touch(absl::Time now);
  bool Expired(absl::Time now) const;

 private:
  Session(std::string id, SessionSpec spec, const KvBlockLayout& layout,
          BlockPool* pool, absl::Duration idle_timeout, absl::Time now,
          std::vector<LayerKvCache> layers);

  const std::string id_;
  const SessionSpec spec_;
  const KvBlockLayout layout_;
  BlockPool* const pool_;
  const absl::Duration idle_timeout_;
  std::atomic<int64_t> last_used_ns_;  // absl::ToUnixNanos

  mutable absl::Mutex mu_;
  std::vector<LayerKvCache> layers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_H_

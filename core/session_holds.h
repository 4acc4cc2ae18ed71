// SessionHolds: the sessions one long-lived user of the engine (a Decode
// stream) has in use, by id.
//
// Each session is held (AttentionEngine::HoldSession: it cannot expire)
// from its first Hold until Clear() or the set's destruction. A hold whose
// session is gone (deleted, moved away, expired and freed) no longer holds
// anything; the next Hold of its id holds whatever session has the id now.
// Such dead holds are dropped whenever the set has doubled since it last
// dropped them, so a user that outlives many sessions keeps about one
// entry per live session it has used, at amortized constant cost per Hold.
//
// Not thread-safe: one owner calls it. The engine must outlive the set.
#ifndef ATTENTION_CORE_SESSION_HOLDS_H_
#define ATTENTION_CORE_SESSION_HOLDS_H_

#include <cstddef>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "core/engine.h"
#include "core/session.h"
#include "core/tenant.h"

namespace attention {

class SessionHolds {
 public:
  explicit SessionHolds(AttentionEngine* engine) : engine_(engine) {}

  // Holds session `id` of `tenant` unless it is held already. On failure
  // the engine's status (NOT_FOUND for an unknown id, UNAVAILABLE while it
  // is being moved, ...) and nothing is held for `id`.
  absl::Status Hold(const std::string& id, const Tenant& tenant);

  // Marks the held session `id` used (nothing when it is not held): its
  // idle clock restarts when its hold ends.
  void MarkUsed(const std::string& id);

  // Lets every session go.
  void Clear() {
    holds_.clear();
    sweep_at_ = kMinSweep;
  }

  // Entries kept, dead holds not yet dropped included.
  size_t size() const { return holds_.size(); }

  // Entries below which dead holds are not looked for.
  static constexpr size_t kMinSweep = 64;

 private:
  // Drops the dead holds once the set has doubled since the last sweep.
  void SweepWhenGrown();

  AttentionEngine* const engine_;
  absl::flat_hash_map<std::string, SessionHold> holds_;
  size_t sweep_at_ = kMinSweep;
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_HOLDS_H_

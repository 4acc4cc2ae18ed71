// MovedSessions: the tombstones a draining replica keeps for the sessions it
// handed over to a peer (session id -> new owner), and the NOT_FOUND status
// that redirects a call on such a session there.
//
// The redirect is an ordinary NOT_FOUND (a moved session is not here) whose
// message names the new owner and which carries the owner as a payload
// (kSessionOwnerPayload), so that the one place turning statuses into gRPC
// statuses (server/status_convert.h) can add the trailing metadata
// `attention-session-owner: host:port` without core knowing gRPC.
//
// A tombstone answers only the tenant that owned the session: to any other
// tenant a moved id looks exactly like an unknown one (no owner leaks).
#ifndef ATTENTION_CORE_MOVED_SESSIONS_H_
#define ATTENTION_CORE_MOVED_SESSIONS_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attention {

// The payload type URL of a moved session's NOT_FOUND; the payload is the
// new owner's "host:port".
inline constexpr char kSessionOwnerPayload[] =
    "type.googleapis.com/attention.v1.SessionOwner";

// NOT_FOUND for session `id`, moved to `owner`: a message saying where it
// went, and the owner as the kSessionOwnerPayload payload.
absl::Status SessionMovedError(absl::string_view id, absl::string_view owner);

// The new owner a status carries (SessionMovedError), if any.
std::optional<std::string> MovedSessionOwner(const absl::Status& status);

// The payload type URL of the UNAVAILABLE a call gets, without waiting, on a
// session being moved right now (sealed); the server turns it into the
// trailing metadata `attention-session-moving: 1`.
inline constexpr char kSessionMovingPayload[] =
    "type.googleapis.com/attention.v1.SessionMoving";

// UNAVAILABLE for session `id`, sealed for a move: nothing was applied;
// retried, the call is redirected (SessionMovedError) once the move ends,
// or runs here if it failed. Carries kSessionMovingPayload.
absl::Status SessionMovingError(absl::string_view id);

// Whether `status` is a SessionMovingError (prefixed or not).
bool IsSessionMoving(const absl::Status& status);

// `status` with `prefix` before its message: same code, same payloads (a
// redirect stays a redirect when a stream or batch names its step).
absl::Status PrefixStatus(absl::string_view prefix, const absl::Status& status);

// Thread-safety: all methods are thread-safe.
class MovedSessions {
 public:
  // Keeps at most `max_entries` tombstones; beyond that the oldest go (a
  // forgotten id is then answered as an unknown one).
  explicit MovedSessions(int64_t max_entries) : max_entries_(max_entries) {}

  MovedSessions(const MovedSessions&) = delete;
  MovedSessions& operator=(const MovedSessions&) = delete;

  // Records that session `id` of tenant `tenant` now lives at `owner`.
  void Add(const std::string& id, const std::string& tenant,
           const std::string& owner);
  // The new owner of `id` when it moved and belonged to `tenant`.
  std::optional<std::string> OwnerOf(const std::string& id,
                                     const std::string& tenant) const;
  // Tombstones held now.
  int64_t size() const;

 private:
  struct Entry {
    std::string tenant;
    std::string owner;
  };

  const int64_t max_entries_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace attention

#endif  // ATTENTION_CORE_MOVED_SESSIONS_H_

#include "core/moved_sessions.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "core/client_string.h"

namespace attention {

absl::Status SessionMovedError(absl::string_view id, absl::string_view owner) {
  absl::Status status = absl::NotFoundError(absl::StrCat(
      "session ", QuoteClientString(id),
      " is not on this replica: it was handed over to ", owner,
      " when this replica drained; send this and later calls on it to ", owner,
      " (trailing metadata attention-session-owner)"));
  status.SetPayload(kSessionOwnerPayload, absl::Cord(owner));
  return status;
}

std::optional<std::string> MovedSessionOwner(const absl::Status& status) {
  absl::optional<absl::Cord> owner = status.GetPayload(kSessionOwnerPayload);
  if (!owner.has_value()) return std::nullopt;
  return std::string(*owner);
}

absl::Status SessionMovingError(absl::string_view id) {
  absl::Status status = absl::UnavailableError(absl::StrCat(
      "session ", QuoteClientString(id),
      " is being moved to another replica (its server is draining); nothing "
      "was applied: retry, and once the move ends the call is redirected to "
      "the session's new replica (trailing metadata "
      "attention-session-moving)"));
  status.SetPayload(kSessionMovingPayload, absl::Cord("1"));
  return status;
}

bool IsSessionMoving(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kSessionMovingPayload).has_value();
}

absl::Status PrefixStatus(absl::string_view prefix,
                          const absl::Status& status) {
  if (status.ok()) return status;
  absl::Status prefixed(status.code(), absl::StrCat(prefix, status.message()));
  status.ForEachPayload(
      [&](absl::string_view type_url, const absl::Cord& payload) {
        prefixed.SetPayload(type_url, payload);
      });
  return prefixed;
}

void MovedSessions::Add(const std::string& id, const std::string& tenant,
                        const std::string& owner) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = entries_.insert_or_assign(id, Entry{tenant, owner});
  if (inserted) order_.push_back(id);
  while (static_cast<int64_t>(order_.size()) > max_entries_) {
    entries_.erase(order_.front());
    order_.pop_front();
  }
}

std::optional<std::string> MovedSessions::OwnerOf(
    const std::string& id, const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.tenant != tenant) return std::nullopt;
  return it->second.owner;
}

int64_t MovedSessions::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(entries_.size());
}

}  // namespace attention

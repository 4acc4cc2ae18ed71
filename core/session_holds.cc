#include "core/session_holds.h"

#include <algorithm>
#include <utility>

#include "core/status_macros.h"

namespace attention {

absl::Status SessionHolds::Hold(const std::string& id, const Tenant& tenant) {
  if (auto held = holds_.find(id); held != holds_.end()) {
    if (!held->second.lost()) return absl::OkStatus();
    holds_.erase(held);
  }
  SweepWhenGrown();
  ATTN_ASSIGN_OR_RETURN(SessionHold hold, engine_->HoldSession(id, tenant));
  holds_.emplace(id, std::move(hold));
  return absl::OkStatus();
}

void SessionHolds::MarkUsed(const std::string& id) {
  if (auto held = holds_.find(id); held != holds_.end()) {
    held->second.MarkUsed();
  }
}

void SessionHolds::SweepWhenGrown() {
  if (holds_.size() < sweep_at_) return;
  absl::erase_if(holds_, [](const auto& entry) { return entry.second.lost(); });
  sweep_at_ = std::max(kMinSweep, 2 * holds_.size());
}

}  // namespace attention

#include "core/change_gate.h"

#include "absl/strings/str_cat.h"

namespace attention {

absl::StatusOr<ChangeGate::Pass> ChangeGate::Enter() {
  absl::MutexLock lock(&mu_);
  if (closed_) {
    return absl::UnavailableError(
        "the server is shutting down and has saved its sessions; retry on "
        "the server that holds the session now");
  }
  ++passes_;
  return Pass(this);
}

void ChangeGate::Leave() {
  absl::MutexLock lock(&mu_);
  --passes_;
}

absl::Status ChangeGate::Close(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  const auto idle = [this]() {
    mu_.AssertHeld();
    return passes_ == 0;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        passes_, " changes to sessions still ran at the deadline"));
  }
  return absl::OkStatus();
}

bool ChangeGate::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

}  // namespace attention

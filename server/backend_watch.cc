#include "server/backend_watch.h"

#include <utility>

namespace attention::server {

BackendWatch::BackendWatch(const AttentionBackend* backend,
                           absl::Duration interval,
                           std::function<void(const absl::Status&)> on_failure)
    : backend_(backend),
      interval_(interval),
      on_failure_(std::move(on_failure)),
      thread_([this] { Run(); }) {}

BackendWatch::~BackendWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

bool BackendWatch::Check() {
  const absl::Status failure = backend_->failure();
  if (failure.ok()) return false;
  {
    absl::MutexLock lock(&mu_);
    if (reported_) return true;
    reported_ = true;
  }
  on_failure_(failure);
  return true;
}

void BackendWatch::Run() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_)) return;
    }
    if (Check()) return;
  }
}

}  // namespace attention::server

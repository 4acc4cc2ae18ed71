#include "server/stall_watchdog.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attention::server {

StallWatchdog::StallWatchdog(absl::Duration timeout,
                             std::function<absl::Time()> now)
    : timeout_(timeout), now_(std::move(now)), thread_([this] { Loop(); }) {}

StallWatchdog::~StallWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

StallWatchdog::Watch::Watch(StallWatchdog* watchdog,
                            std::function<void()> cancel)
    : watchdog_(watchdog),
      cancel_(std::move(cancel)),
      last_progress_ns_(watchdog->NowNanos()) {
  absl::MutexLock lock(&watchdog_->mu_);
  watchdog_->watches_.insert(this);
}

StallWatchdog::Watch::~Watch() {
  absl::MutexLock lock(&watchdog_->mu_);
  watchdog_->watches_.erase(this);
}

void StallWatchdog::Watch::Progress() {
  last_progress_ns_.store(watchdog_->NowNanos(), std::memory_order_relaxed);
}

StallWatchdog::Watch StallWatchdog::Start(std::function<void()> cancel) {
  return Watch(this, std::move(cancel));
}

void StallWatchdog::CancelStalled() {
  const int64_t stalled_before =
      NowNanos() - absl::ToInt64Nanoseconds(timeout_);
  // Under the lock, so that no Watch (nor its call) goes meanwhile.
  absl::MutexLock lock(&mu_);
  for (Watch* watch : watches_) {
    if (watch->stalled() || watch->last_progress_ns_.load(
                                std::memory_order_relaxed) > stalled_before) {
      continue;
    }
    watch->stalled_.store(true, std::memory_order_release);
    watch->cancel_();
  }
}

absl::Status StallWatchdog::StallError(absl::string_view what) const {
  return absl::CancelledError(absl::StrCat(
      "the ", what, " moved no message for ", absl::FormatDuration(timeout_),
      " (--transfer_stall_timeout), so the server cancelled it; keep the "
      "stream moving or set a longer timeout"));
}

void StallWatchdog::Loop() {
  const absl::Duration interval = std::min(timeout_ / 4, absl::Seconds(1));
  const auto watching = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !watches_.empty();
  };
  while (true) {
    {
      // Sleep while nothing is watched, then check every interval.
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&watching));
      if (stopping_ ||
          mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval)) {
        return;
      }
    }
    CancelStalled();
  }
}

}  // namespace attention::server

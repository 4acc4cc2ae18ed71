#include "server/call_executor.h"

#include <utility>

namespace attention::server {

CallExecutor::CallExecutor(int num_threads, int64_t max_queued,
                           int64_t max_queued_bytes)
    : max_queued_(max_queued), max_queued_bytes_(max_queued_bytes) {
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this] { ThreadMain(); });
  }
}

CallExecutor::~CallExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void CallExecutor::Schedule(absl::AnyInvocable<void() &&> work) {
  absl::MutexLock lock(&mu_);
  queue_.push_back({std::move(work), 0});
}

CallExecutor::Admission CallExecutor::TrySchedule(
    absl::AnyInvocable<void() &&> work, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  Admission admission{.waiting = static_cast<int64_t>(queue_.size()),
                      .waiting_bytes = queued_bytes_};
  admission.queued =
      queue_.empty() || (admission.waiting < max_queued_ &&
                         queued_bytes_ + bytes <= max_queued_bytes_);
  if (admission.queued) {
    queue_.push_back({std::move(work), bytes});
    queued_bytes_ += bytes;
  }
  return admission;
}

void CallExecutor::ThreadMain() {
  auto work_or_stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || stopping_;
  };
  while (true) {
    absl::AnyInvocable<void() &&> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&work_or_stop));
      if (queue_.empty()) return;  // stopping, nothing left
      work = std::move(queue_.front().work);
      queued_bytes_ -= queue_.front().bytes;
      queue_.pop_front();
    }
    std::move(work)();
  }
}

}  // namespace attention::server

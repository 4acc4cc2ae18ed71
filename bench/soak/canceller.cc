#include "bench/soak/canceller.h"

#include <algorithm>

namespace attention::soak {

Canceller::Canceller(uint64_t seed, absl::Duration mean_interval)
    : rng_(seed), mean_interval_(mean_interval), thread_([this] { Run(); }) {}

Canceller::~Canceller() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

Canceller::Scope::Scope(Canceller* canceller, grpc::ClientContext* context)
    : canceller_(canceller), context_(context) {
  if (canceller_ == nullptr) return;
  absl::MutexLock lock(&canceller_->mu_);
  canceller_->contexts_.push_back(context_);
}

Canceller::Scope::~Scope() {
  if (canceller_ == nullptr) return;
  absl::MutexLock lock(&canceller_->mu_);
  auto& contexts = canceller_->contexts_;
  contexts.erase(std::find(contexts.begin(), contexts.end(), context_));
}

int64_t Canceller::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

void Canceller::Run() {
  std::exponential_distribution<double> gap(
      1.0 / absl::ToDoubleMicroseconds(mean_interval_));
  absl::MutexLock lock(&mu_);
  while (true) {
    // Wakes early only to stop.
    const absl::Duration wait = absl::Microseconds(gap(rng_));
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), wait)) return;
    if (contexts_.empty()) continue;
    // TryCancel under the lock: a Scope cannot end (and its context be
    // destroyed) meanwhile.
    std::uniform_int_distribution<size_t> pick(0, contexts_.size() - 1);
    contexts_[pick(rng_)]->TryCancel();
    ++cancelled_;
  }
}

}  // namespace attention::soak

#include "bench/soak/session_pool.h"

#include <algorithm>
#include <utility>

namespace attention::soak {

std::optional<PooledSession> SessionPool::Add(PooledSession session) {
  absl::MutexLock lock(&mu_);
  std::optional<PooledSession> evicted;
  if (sessions_.size() >= capacity_ && !sessions_.empty()) {
    evicted = std::move(sessions_.front());
    sessions_.erase(sessions_.begin());
  }
  sessions_.push_back(std::move(session));
  return evicted;
}

std::optional<PooledSession> SessionPool::Pick(std::mt19937_64& rng) const {
  absl::MutexLock lock(&mu_);
  if (sessions_.empty()) return std::nullopt;
  std::uniform_int_distribution<size_t> index(0, sessions_.size() - 1);
  return sessions_[index(rng)];
}

std::vector<PooledSession> SessionPool::PickSome(size_t count,
                                                 std::mt19937_64& rng) const {
  absl::MutexLock lock(&mu_);
  std::vector<PooledSession> picked;
  std::sample(sessions_.begin(), sessions_.end(), std::back_inserter(picked),
              count, rng);
  return picked;
}

std::optional<PooledSession> SessionPool::Take(std::mt19937_64& rng) {
  absl::MutexLock lock(&mu_);
  if (sessions_.empty()) return std::nullopt;
  std::uniform_int_distribution<size_t> index(0, sessions_.size() - 1);
  const size_t i = index(rng);
  PooledSession taken = std::move(sessions_[i]);
  sessions_.erase(sessions_.begin() + static_cast<std::ptrdiff_t>(i));
  return taken;
}

std::vector<PooledSession> SessionPool::TakeAll() {
  absl::MutexLock lock(&mu_);
  return std::exchange(sessions_, {});
}

}  // namespace attention::soak

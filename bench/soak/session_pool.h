// attn-soak: the sessions one worker process holds, shared by its threads so
// that their calls on one session (decodes, truncates, forks, deletes) race.
#ifndef ATTENTION_BENCH_SOAK_SESSION_POOL_H_
#define ATTENTION_BENCH_SOAK_SESSION_POOL_H_

#include <cstddef>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "attention/v1/attention.pb.h"

namespace attention::soak {

struct PooledSession {
  std::string id;
  v1::SessionSpec spec;  // resolved by the server
};

class SessionPool {
 public:
  explicit SessionPool(size_t capacity) : capacity_(capacity) {}

  // Adds `session`. When the pool is full, removes and returns the oldest
  // session, which the caller deletes.
  std::optional<PooledSession> Add(PooledSession session);
  // A session chosen at random (it stays in the pool); none when empty.
  std::optional<PooledSession> Pick(std::mt19937_64& rng) const;
  // Up to `count` distinct sessions chosen at random.
  std::vector<PooledSession> PickSome(size_t count, std::mt19937_64& rng) const;
  // Removes a session chosen at random; none when empty.
  std::optional<PooledSession> Take(std::mt19937_64& rng);
  // Removes every session.
  std::vector<PooledSession> TakeAll();

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<PooledSession> sessions_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace attention::soak

#endif  // ATTENTION_BENCH_SOAK_SESSION_POOL_H_

// CallExecutor: a fixed set of threads that run queued closures in FIFO
// order, with a bounded queue. The callback-API handlers hand long engine
// calls (Prefill) here, so that gRPC's callback threads never block on the
// engine and no thread is created per call; the bound keeps a flood of
// calls (each holding its request) from taking the server's memory.
#ifndef ATTENTION_SERVER_CALL_EXECUTOR_H_
#define ATTENTION_SERVER_CALL_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <limits>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

// Thread-safety: TrySchedule may be called from any thread, also from a
// closure the executor runs.
class CallExecutor {
 public:
  // Starts `num_threads` (>= 1) threads; TrySchedule lets at most
  // `max_queued` (>= 1) closures wait to start.
  explicit CallExecutor(
      int num_threads,
      int64_t max_queued = std::numeric_limits<int64_t>::max());
  // Runs every closure still queued, then joins the threads. REQUIRES: no
  // Schedule call in progress or to come from outside the executor.
  ~CallExecutor();

  CallExecutor(const CallExecutor&) = delete;
  CallExecutor& operator=(const CallExecutor&) = delete;

  // Runs `work` on one of the threads, after the closures queued before it
  // have started, and returns true; or returns false (and drops `work`)
  // when max_queued closures already wait to start.
  bool TrySchedule(absl::AnyInvocable<void() &&> work);
  // As TrySchedule, but always queues: for work that must run, whose
  // caller bounds how much of it waits.
  void Schedule(absl::AnyInvocable<void() &&> work);

  int64_t max_queued() const { return max_queued_; }

 private:
  void ThreadMain();

  const int64_t max_queued_;
  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_CALL_EXECUTOR_H_

// CallExecutor: a fixed set of threads that run queued closures in FIFO
// order, with a queue bounded in closures and in the bytes they hold. The
// callback-API handlers hand long engine calls (Prefill) here, so that
// gRPC's callback threads never block on the engine and no thread is
// created per call; the bounds keep a flood of calls (each holding its
// request and reply) from taking the server's memory.
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
  // `max_queued` (>= 1) closures, holding at most `max_queued_bytes`
  // (>= 0) between them, wait to start. A closure always may wait when none
  // does, whatever it holds.
  explicit CallExecutor(
      int num_threads, int64_t max_queued = std::numeric_limits<int64_t>::max(),
      int64_t max_queued_bytes = std::numeric_limits<int64_t>::max());
  // Runs every closure still queued, then joins the threads. REQUIRES: no
  // Schedule call in progress or to come from outside the executor.
  ~CallExecutor();

  CallExecutor(const CallExecutor&) = delete;
  CallExecutor& operator=(const CallExecutor&) = delete;

  // What TrySchedule did, and what was waiting to start when it looked.
  struct Admission {
    bool queued = false;
    int64_t waiting = 0;        // closures
    int64_t waiting_bytes = 0;  // the bytes they hold
  };
  // Runs `work`, which holds `bytes` of memory until it starts, on one of
  // the threads after the closures queued before it have started; or drops
  // it when max_queued closures already wait or their bytes plus `bytes`
  // would pass max_queued_bytes.
  Admission TrySchedule(absl::AnyInvocable<void() &&> work, int64_t bytes = 0);
  // As TrySchedule, but always queues: for work that must run, whose
  // caller bounds how much of it waits.
  void Schedule(absl::AnyInvocable<void() &&> work);

  int64_t max_queued() const { return max_queued_; }
  int64_t max_queued_bytes() const { return max_queued_bytes_; }

 private:
  struct Waiting {
    absl::AnyInvocable<void() &&> work;
    int64_t bytes;
  };

  void ThreadMain();

  const int64_t max_queued_;
  const int64_t max_queued_bytes_;
  absl::Mutex mu_;
  std::deque<Waiting> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_CALL_EXECUTOR_H_

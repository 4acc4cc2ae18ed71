// CallExecutor: a fixed set of threads that run queued closures in FIFO
// order. The callback-API handlers hand long engine calls (Prefill) here, so
// that gRPC's callback threads never block on the engine and no thread is
// created per call.
#ifndef ATTENTION_SERVER_CALL_EXECUTOR_H_
#define ATTENTION_SERVER_CALL_EXECUTOR_H_

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace attention::server {

// Thread-safety: Schedule may be called from any thread, also from a
// closure the executor runs.
class CallExecutor {
 public:
  // Starts `num_threads` (>= 1) threads.
  explicit CallExecutor(int num_threads);
  // Runs every closure still queued, then joins the threads. REQUIRES: no
  // Schedule call in progress or to come from outside the executor.
  ~CallExecutor();

  CallExecutor(const CallExecutor&) = delete;
  CallExecutor& operator=(const CallExecutor&) = delete;

  // Runs `work` on one of the threads, after the closures queued before it
  // have started.
  void Schedule(absl::AnyInvocable<void() &&> work);

 private:
  void ThreadMain();

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_CALL_EXECUTOR_H_

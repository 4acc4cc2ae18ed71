// ThreadPool: a fixed set of persistent worker threads for data-parallel
// loops. No thread is created per call.
#ifndef ATTENTION_CORE_THREAD_POOL_H_
#define ATTENTION_CORE_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention {

// The CPUs this process may run on (its affinity mask: a container's
// cpuset, taskset), at least 1; std::thread::hardware_concurrency() counts
// the machine's instead.
int UsableCpus();

// Thread-safety: ParallelFor may be called from many threads at once; the
// calls share the workers. The calling thread takes part in its own loop, so
// nested or concurrent loops always make progress.
class ThreadPool {
 public:
  // Starts `num_threads - 1` workers (the caller is the last thread).
  // num_threads <= 0 means UsableCpus(). An idle
  // worker, and a caller waiting for workers to finish, poll for up to
  // `spin` before sleeping: calls that follow each other closely (one per
  // decode step and layer) then start without a wake-up, at the price of
  // up to `spin` of CPU time per idle period. Zero sleeps at once.
  explicit ThreadPool(int num_threads, absl::Duration spin = kDefaultSpin);

  // No polling unless asked: on a small machine a polling worker takes CPU
  // from the RPC threads (measured: it slowed DecodeStep on 2 cores).
  static constexpr absl::Duration kDefaultSpin = absl::ZeroDuration();
  ~ThreadPool();  // joins the workers

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) and returns when all have finished.
  // Which thread runs which index is unspecified, so fn must not depend on
  // it for its results.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Loop;
  void WorkerMain();
  // Runs indices of `loop` until none are left; returns how many it ran.
  static int64_t Drain(Loop& loop);
  // Stops offering `loop` to workers. REQUIRES: mu_ held.
  void Withdraw(Loop* loop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration spin_;

  absl::Mutex mu_;
  std::vector<Loop*> loops_ ABSL_GUARDED_BY(mu_);  // loops with work left
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Lock-free mirrors for the spinning workers: loops_.size() and stopping_.
  std::atomic<int> offered_loops_{0};
  std::atomic<bool> stopping_flag_{false};
  std::vector<std::thread> workers_;
};

}  // namespace attention

#endif  // ATTENTION_CORE_THREAD_POOL_H_

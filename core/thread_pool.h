// ThreadPool: a fixed set of persistent worker threads for data-parallel
// loops. No thread is created per call.
#ifndef ATTENTION_CORE_THREAD_POOL_H_
#define ATTENTION_CORE_THREAD_POOL_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attention {

// Thread-safety: ParallelFor may be called from many threads at once; the
// calls share the workers. The calling thread takes part in its own loop, so
// nested or concurrent loops always make progress.
class ThreadPool {
 public:
  // Starts `num_threads - 1` workers (the caller is the last thread).
  // num_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
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

  absl::Mutex mu_;
  std::vector<Loop*> loops_ ABSL_GUARDED_BY(mu_);  // loops with work left
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace attention

#endif  // ATTENTION_CORE_THREAD_POOL_H_

#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace attention {

// One ParallelFor call. It lives on the caller's stack; the caller does not
// return before every attached worker has detached, so workers never touch a
// dead Loop.
struct ThreadPool::Loop {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};  // next index to claim
  // Guarded by the pool's mu_.
  int64_t completed = 0;  // indices finished
  int attached = 0;       // workers currently draining this loop
};

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::thread::hardware_concurrency());
    if (num_threads <= 0) num_threads = 1;
  }
  workers_.reserve(num_threads - 1);
  for (int i = 0; i + 1 < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerMain(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

int64_t ThreadPool::Drain(Loop& loop) {
  int64_t ran = 0;
  while (true) {
    const int64_t i = loop.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= loop.n) break;
    (*loop.fn)(i);
    ++ran;
  }
  return ran;
}

void ThreadPool::WorkerMain() {
  while (true) {
    Loop* loop;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* pool) {
            return pool->stopping_ || !pool->loops_.empty();
          },
          this));
      if (stopping_) return;
      loop = loops_.front();
      ++loop->attached;
    }
    const int64_t ran = Drain(*loop);
    {
      absl::MutexLock lock(&mu_);
      // Every index is claimed now: stop offering the loop to workers.
      auto it = std::find(loops_.begin(), loops_.end(), loop);
      if (it != loops_.end()) loops_.erase(it);
      loop->completed += ran;
      --loop->attached;
    }
  }
}

void ThreadPool::ParallelFor(int64_t n,
                             const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Loop loop;
  loop.fn = &fn;
  loop.n = n;
  {
    absl::MutexLock lock(&mu_);
    loops_.push_back(&loop);
  }
  const int64_t ran = Drain(loop);
  absl::MutexLock lock(&mu_);
  auto it = std::find(loops_.begin(), loops_.end(), &loop);
  if (it != loops_.end()) loops_.erase(it);
  loop.completed += ran;
  // Wait for indices other threads claimed, and for them to let go of loop.
  mu_.Await(absl::Condition(
      +[](Loop* l) { return l->completed == l->n && l->attached == 0; },
      &loop));
}

}  // namespace attention

#include "core/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace attention {
namespace {

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins on `done` for up to `spin`; true when it became true. Checks the
// clock only every few dozen polls (reading it costs more than a poll).
template <typename Done>
bool SpinUntil(absl::Duration spin, Done done) {
  if (spin <= absl::ZeroDuration()) return done();
  const auto deadline =
      std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(spin);
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      CpuRelax();
    }
    std::this_thread::yield();
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace

// One ParallelFor call. It lives on the caller's stack; the caller does not
// return before every attached worker has detached, so workers never touch a
// dead Loop.
struct ThreadPool::Loop {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0};       // next index to claim
  std::atomic<int64_t> completed{0};  // indices finished (see attached)
  // Workers draining this loop. Changed only under the pool's mu_ (an
  // increment only while the loop is offered); atomic so that the caller
  // can spin on it without the lock.
  std::atomic<int> attached{0};

  bool Finished() const {
    return completed.load(std::memory_order_acquire) == n &&
           attached.load(std::memory_order_acquire) == 0;
  }
};

int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

ThreadPool::ThreadPool(int num_threads, absl::Duration spin) : spin_(spin) {
  if (num_threads <= 0) num_threads = UsableCpus();
  workers_.reserve(num_threads - 1);
  for (int i = 0; i + 1 < num_threads; ++i) {
    workers_.emplace_back([this] { WorkerMain(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    stopping_flag_.store(true, std::memory_order_relaxed);
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
    // Poll briefly before sleeping: a decode step arriving within the spin
    // window starts on both threads without a wake-up (tens of
    // microseconds on a virtual machine).
    SpinUntil(spin_, [this] {
      return offered_loops_.load(std::memory_order_relaxed) > 0 ||
             stopping_flag_.load(std::memory_order_relaxed);
    });
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
      loop->attached.fetch_add(1, std::memory_order_relaxed);
    }
    const int64_t ran = Drain(*loop);
    {
      absl::MutexLock lock(&mu_);
      // Every index is claimed now: stop offering the loop to workers.
      Withdraw(loop);
      // Under mu_, so that a caller sleeping in Await re-checks; the
      // decrement is this worker's last touch of the loop.
      loop->completed.fetch_add(ran, std::memory_order_release);
      loop->attached.fetch_sub(1, std::memory_order_release);
    }
  }
}

void ThreadPool::Withdraw(Loop* loop) {
  auto it = std::find(loops_.begin(), loops_.end(), loop);
  if (it != loops_.end()) {
    loops_.erase(it);
    offered_loops_.fetch_sub(1, std::memory_order_relaxed);
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
    offered_loops_.fetch_add(1, std::memory_order_relaxed);
  }
  const int64_t ran = Drain(loop);
  {
    absl::MutexLock lock(&mu_);
    // From here on no worker can attach.
    Withdraw(&loop);
  }
  loop.completed.fetch_add(ran, std::memory_order_release);
  // Wait for indices other threads claimed, and for them to let go of loop:
  // spin first (they are usually about to finish), then sleep.
  if (SpinUntil(spin_, [&loop] { return loop.Finished(); })) return;
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Loop* l) { return l->Finished(); }, &loop));
}

}  // namespace attention

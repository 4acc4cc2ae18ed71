#include "core/thread_pool.h"

#include <sched.h>

#include <atomic>
#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

// Every behaviour holds whether idle threads sleep at once or poll first.
class ThreadPoolTest : public ::testing::TestWithParam<absl::Duration> {
 protected:
  absl::Duration spin() const { return GetParam(); }
};

INSTANTIATE_TEST_SUITE_P(
    SleepOrSpin, ThreadPoolTest,
    ::testing::Values(absl::ZeroDuration(), absl::Microseconds(200)),
    [](const ::testing::TestParamInfo<absl::Duration>& info) {
      return info.param == absl::ZeroDuration() ? std::string("Sleep")
                                                : std::string("Spin");
    });

TEST_P(ThreadPoolTest, ThreadCount) {
  EXPECT_EQ(ThreadPool(1, spin()).num_threads(), 1);
  EXPECT_EQ(ThreadPool(4, spin()).num_threads(), 4);
  EXPECT_GE(ThreadPool(0, spin()).num_threads(), 1);
}

TEST_P(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads, spin());
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << i;
    }
  }
}

TEST_P(ThreadPoolTest, WorkersTakePart) {
  ThreadPool pool(4, spin());
  absl::Mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> started{0};
  // Each index waits briefly for the others to start, so several threads
  // must be running indices at once.
  pool.ParallelFor(4, [&](int64_t) {
    started.fetch_add(1);
    {
      absl::MutexLock lock(&mu);
      ids.insert(std::this_thread::get_id());
    }
    for (int spin = 0; spin < 2000000 && started.load() < 2; ++spin) {
      std::this_thread::yield();
    }
  });
  EXPECT_GE(ids.size(), 2u);
}

TEST_P(ThreadPoolTest, ConcurrentCallersShareTheWorkers) {
  ThreadPool pool(3, spin());
  constexpr int kCallers = 6;
  constexpr int64_t kN = 500;
  std::vector<std::vector<int>> results(kCallers, std::vector<int>(kN));
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 20; ++round) {
        pool.ParallelFor(kN, [&](int64_t i) { results[c][i] += 1; });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    for (int64_t i = 0; i < kN; ++i) EXPECT_EQ(results[c][i], 20);
  }
}

TEST_P(ThreadPoolTest, NestedLoopsComplete) {
  ThreadPool pool(2, spin());
  std::atomic<int64_t> total{0};
  pool.ParallelFor(8, [&](int64_t i) {
    pool.ParallelFor(16, [&](int64_t j) { total.fetch_add(i * 16 + j); });
  });
  const int64_t n = 8 * 16;
  EXPECT_EQ(total.load(), n * (n - 1) / 2);
}

TEST_P(ThreadPoolTest, DestructionWithIdleWorkers) {
  for (int i = 0; i < 20; ++i) {
    ThreadPool pool(4, spin());
    std::atomic<int> count{0};
    pool.ParallelFor(10, [&](int64_t) { count.fetch_add(1); });
    EXPECT_EQ(count.load(), 10);
  }
}

TEST_P(ThreadPoolTest, LoopsSpacedOutStillUseTheWorkers) {
  // Calls a little apart, like decode steps: workers that went idle (and,
  // with spin, polled) must still pick up later loops.
  ThreadPool pool(2, spin());
  for (int round = 0; round < 5; ++round) {
    absl::SleepFor(absl::Microseconds(300));
    std::atomic<int> started{0};
    absl::Mutex mu;
    std::set<std::thread::id> ids;
    pool.ParallelFor(2, [&](int64_t) {
      started.fetch_add(1);
      {
        absl::MutexLock lock(&mu);
        ids.insert(std::this_thread::get_id());
      }
      for (int wait = 0; wait < 2000000 && started.load() < 2; ++wait) {
        std::this_thread::yield();
      }
    });
    EXPECT_EQ(ids.size(), 2u) << "round " << round;
  }
}

// The default thread count follows the affinity (a container's cpuset),
// not the machine's CPU count.
TEST(UsableCpusTest, FollowsTheAffinity) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  EXPECT_EQ(UsableCpus(), CPU_COUNT(&all));
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(UsableCpus(), 1);
  EXPECT_EQ(ThreadPool(0).num_threads(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(all), &all), 0);
}

}  // namespace
}  // namespace attention

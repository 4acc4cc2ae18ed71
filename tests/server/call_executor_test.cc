#include "server/call_executor.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(CallExecutorTest, RunsClosuresInOrderAndBoundsTheWaitingOnes) {
  std::vector<int> order;
  absl::Mutex mu;
  absl::Notification started;
  absl::Notification release;
  {
    CallExecutor executor(/*num_threads=*/1, /*max_queued=*/2);
    ASSERT_TRUE(executor
                    .TrySchedule([&] {
                      started.Notify();
                      release.WaitForNotification();
                    })
                    .queued);
    started.WaitForNotification();  // the only thread is busy
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(executor
                      .TrySchedule([&, i] {
                        absl::MutexLock lock(&mu);
                        order.push_back(i);
                      })
                      .queued);
    }
    bool ran = false;
    const CallExecutor::Admission refused =
        executor.TrySchedule([&] { ran = true; });
    EXPECT_FALSE(refused.queued);
    EXPECT_EQ(refused.waiting, 2);
    release.Notify();
    // Destruction runs what is queued, then joins.
    EXPECT_FALSE(ran);
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

// The waiting closures' bytes are bounded too: a closure that would pass
// the bound is dropped, one alone may hold more, and the bytes of a
// closure that has started no longer count.
TEST(CallExecutorTest, BoundsTheBytesTheWaitingClosuresHold) {
  absl::Notification started;
  absl::Notification release;
  std::atomic<int> runs{0};
  {
    CallExecutor executor(/*num_threads=*/1, /*max_queued=*/8,
                          /*max_queued_bytes=*/100);
    // Running, not waiting: its bytes do not count.
    ASSERT_TRUE(executor
                    .TrySchedule(
                        [&] {
                          started.Notify();
                          release.WaitForNotification();
                        },
                        /*bytes=*/1000)
                    .queued);
    started.WaitForNotification();
    // Alone, a closure may hold more than the bound.
    EXPECT_TRUE(executor.TrySchedule([&] { ++runs; }, 150).queued);
    const CallExecutor::Admission refused =
        executor.TrySchedule([&] { ++runs; }, 1);
    EXPECT_FALSE(refused.queued);
    EXPECT_EQ(refused.waiting, 1);
    EXPECT_EQ(refused.waiting_bytes, 150);
    release.Notify();
  }
  EXPECT_EQ(runs.load(), 1);
  // Before the executor: its destructor joins a thread that may still be
  // waiting on them.
  absl::Notification busy;
  absl::Notification go;
  CallExecutor executor(/*num_threads=*/1, /*max_queued=*/8,
                        /*max_queued_bytes=*/100);
  ASSERT_TRUE(executor
                  .TrySchedule([&] {
                    busy.Notify();
                    go.WaitForNotification();
                  })
                  .queued);
  busy.WaitForNotification();
  EXPECT_TRUE(executor.TrySchedule([&] { ++runs; }, 60).queued);
  EXPECT_TRUE(executor.TrySchedule([&] { ++runs; }, 40).queued);  // at 100
  EXPECT_FALSE(executor.TrySchedule([&] { ++runs; }, 1).queued);
  go.Notify();
}

TEST(CallExecutorTest, AClosureMayScheduleMore) {
  std::atomic<int> runs{0};
  absl::Notification done;
  CallExecutor executor(/*num_threads=*/2, /*max_queued=*/4);
  ASSERT_TRUE(executor
                  .TrySchedule([&] {
                    ++runs;
                    EXPECT_TRUE(executor
                                    .TrySchedule([&] {
                                      ++runs;
                                      done.Notify();
                                    })
                                    .queued);
                  })
                  .queued);
  done.WaitForNotification();
  EXPECT_EQ(runs.load(), 2);
}

}  // namespace
}  // namespace attention::server

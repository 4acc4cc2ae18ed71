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
    ASSERT_TRUE(executor.TrySchedule([&] {
      started.Notify();
      release.WaitForNotification();
    }));
    started.WaitForNotification();  // the only thread is busy
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(executor.TrySchedule([&, i] {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      }));
    }
    bool ran = false;
    EXPECT_FALSE(executor.TrySchedule([&] { ran = true; }));
    release.Notify();
    // Destruction runs what is queued, then joins.
    EXPECT_FALSE(ran);
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

TEST(CallExecutorTest, AClosureMayScheduleMore) {
  std::atomic<int> runs{0};
  absl::Notification done;
  CallExecutor executor(/*num_threads=*/2, /*max_queued=*/4);
  ASSERT_TRUE(executor.TrySchedule([&] {
    ++runs;
    EXPECT_TRUE(executor.TrySchedule([&] {
      ++runs;
      done.Notify();
    }));
  }));
  done.WaitForNotification();
  EXPECT_EQ(runs.load(), 2);
}

}  // namespace
}  // namespace attention::server

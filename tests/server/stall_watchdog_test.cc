#include "server/stall_watchdog.h"

#include <atomic>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// A clock that moves only when the test moves it.
class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  std::function<absl::Time()> AsFunction() {
    return [this] { return Now(); };
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
};

TEST(StallWatchdogTest, CancelsOnlyCallsThatStoppedMoving) {
  FakeClock clock;
  StallWatchdog watchdog(absl::Seconds(10), clock.AsFunction());
  int moving_cancels = 0;
  int stalled_cancels = 0;
  StallWatchdog::Watch moving = watchdog.Start([&] { ++moving_cancels; });
  StallWatchdog::Watch stalled = watchdog.Start([&] { ++stalled_cancels; });

  clock.Advance(absl::Seconds(6));
  moving.Progress();
  watchdog.CancelStalled();
  EXPECT_FALSE(stalled.stalled());

  clock.Advance(absl::Seconds(6));  // 12 s since `stalled` started
  moving.Progress();
  watchdog.CancelStalled();
  EXPECT_TRUE(stalled.stalled());
  EXPECT_EQ(stalled_cancels, 1);
  EXPECT_FALSE(moving.stalled());
  EXPECT_EQ(moving_cancels, 0);

  // Cancelled once, however often it is checked again.
  clock.Advance(absl::Seconds(30));
  watchdog.CancelStalled();
  EXPECT_EQ(stalled_cancels, 1);
  EXPECT_TRUE(moving.stalled());
  EXPECT_EQ(moving_cancels, 1);
}

TEST(StallWatchdogTest, ItsThreadCancelsAStalledCall) {
  FakeClock clock;
  StallWatchdog watchdog(absl::Milliseconds(40), clock.AsFunction());
  absl::Notification cancelled;
  StallWatchdog::Watch watch = watchdog.Start([&] { cancelled.Notify(); });
  clock.Advance(absl::Seconds(1));
  // The thread checks every 10 ms; generous bound so a loaded machine
  // cannot fail the test.
  EXPECT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(watch.stalled());
}

TEST(StallWatchdogTest, AGoneWatchIsNeverCancelled) {
  FakeClock clock;
  StallWatchdog watchdog(absl::Seconds(1), clock.AsFunction());
  std::atomic<int> cancels{0};
  {
    StallWatchdog::Watch watch = watchdog.Start([&] { ++cancels; });
  }
  clock.Advance(absl::Seconds(5));
  watchdog.CancelStalled();
  EXPECT_EQ(cancels.load(), 0);
}

TEST(StallWatchdogTest, TheErrorNamesTheTimeoutAndTheFlag) {
  StallWatchdog watchdog(absl::Seconds(60));
  const absl::Status error = watchdog.StallError("import");
  EXPECT_EQ(error.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(absl::StrContains(error.message(), "import moved no message"));
  EXPECT_TRUE(absl::StrContains(error.message(), "1m"));
  EXPECT_TRUE(absl::StrContains(error.message(), "--transfer_stall_timeout"));
}

}  // namespace
}  // namespace attention::server

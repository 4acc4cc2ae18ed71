// BackendWatch reports a backend that failed for good exactly once, from
// its polling thread or from Check(); the server turns NOT_SERVING on it.
#include "server/backend_watch.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// Only failure() matters to the watch.
class FailingBackend final : public AttentionBackend {
 public:
  void Fail(absl::Status failure) {
    absl::MutexLock lock(&mu_);
    failure_ = std::move(failure);
  }
  absl::Status failure() const override {
    absl::MutexLock lock(&mu_);
    return failure_;
  }
  absl::string_view name() const override { return "fake"; }
  std::string device() const override { return "fake"; }
  absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(int64_t) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status WriteKv(const KvWrite&) override { return failure(); }
  absl::Status CopyBlock(const std::byte*, std::byte*, int64_t) override {
    return failure();
  }
  absl::Status ReadBlock(const std::byte*, std::byte*, int64_t) override {
    return failure();
  }
  absl::Status Attend(absl::Span<const AttentionProblem>) override {
    return failure();
  }

 private:
  mutable absl::Mutex mu_;
  absl::Status failure_;
};

TEST(BackendWatchTest, ReportsAFailureOnceFromItsThread) {
  FailingBackend backend;
  std::atomic<int> reports{0};
  absl::Notification reported;
  std::string message;
  BackendWatch watch(&backend, absl::Milliseconds(5),
                     [&](const absl::Status& failure) {
                       message = std::string(failure.message());
                       if (reports.fetch_add(1) == 0) reported.Notify();
                     });
  EXPECT_FALSE(watch.Check());
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(reports.load(), 0);
  backend.Fail(absl::UnavailableError("illegal address"));
  ASSERT_TRUE(reported.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(message, "illegal address");
  EXPECT_TRUE(watch.Check());
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(reports.load(), 1);
}

TEST(BackendWatchTest, CheckReportsAtOnceAndStopsPromptly) {
  FailingBackend backend;
  int reports = 0;
  const absl::Time start = absl::Now();
  {
    BackendWatch watch(&backend, absl::Hours(1),
                       [&](const absl::Status&) { ++reports; });
    backend.Fail(absl::UnavailableError("gone"));
    EXPECT_TRUE(watch.Check());
    EXPECT_TRUE(watch.Check());
  }
  EXPECT_EQ(reports, 1);
  EXPECT_LT(absl::Now() - start, absl::Minutes(1));
}

}  // namespace
}  // namespace attention::server

#include "core/change_gate.h"

#include <atomic>
#include <optional>
#include <thread>
#include <utility>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace attention {
namespace {

TEST(ChangeGateTest, ClosingWaitsForThePassesOutAndRefusesNewOnes) {
  ChangeGate gate;
  absl::StatusOr<ChangeGate::Pass> first = gate.Enter();
  ASSERT_TRUE(first.ok()) << first.status();
  std::optional<ChangeGate::Pass> running(*std::move(first));
  absl::Notification closed;
  absl::Status close_status;
  std::thread closer([&] {
    close_status = gate.Close(absl::InfiniteFuture());
    closed.Notify();
  });
  // The closer waits for the running change; newcomers are refused now.
  while (!gate.closed()) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_FALSE(closed.HasBeenNotified());
  const absl::StatusOr<ChangeGate::Pass> late = gate.Enter();
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable);
  running.reset();
  closer.join();
  EXPECT_TRUE(close_status.ok()) << close_status;
}

TEST(ChangeGateTest, ClosingGivesUpAtTheDeadline) {
  ChangeGate gate;
  absl::StatusOr<ChangeGate::Pass> stuck = gate.Enter();
  ASSERT_TRUE(stuck.ok());
  const absl::Status status = gate.Close(absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("1 changes"), absl::string_view::npos)
      << status;
  EXPECT_TRUE(gate.closed());
}

TEST(ChangeGateTest, AMovedPassCountsOnce) {
  ChangeGate gate;
  {
    absl::StatusOr<ChangeGate::Pass> pass = gate.Enter();
    ASSERT_TRUE(pass.ok());
    ChangeGate::Pass moved(*std::move(pass));
  }
  EXPECT_TRUE(gate.Close(absl::Now()).ok());
}

}  // namespace
}  // namespace attention

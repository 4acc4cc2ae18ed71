#include "server/open_streams.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

class CountingStream : public OpenStreamListener {
 public:
  explicit CountingStream(const OpenStreams* streams = nullptr)
      : streams_(streams) {}
  void OnTenantsChanged() override { calls.fetch_add(1); }
  void OnEndIdle() override {
    end_idle_calls.fetch_add(1);
    // Set before any stream hears of it.
    if (streams_ != nullptr && !streams_->ending_idle()) unset.fetch_add(1);
  }
  std::atomic<int> calls{0};
  std::atomic<int> end_idle_calls{0};
  std::atomic<int> unset{0};

 private:
  const OpenStreams* streams_;
};

TEST(OpenStreamsTest, EveryRegisteredStreamHearsOfAChange) {
  OpenStreams streams;
  CountingStream a, b;
  streams.Add(&a);
  streams.Add(&b);
  streams.TenantsChanged();
  EXPECT_EQ(a.calls.load(), 1);
  EXPECT_EQ(b.calls.load(), 1);
  streams.Remove(&a);
  streams.Remove(&a);  // nothing
  streams.TenantsChanged();
  EXPECT_EQ(a.calls.load(), 1);
  EXPECT_EQ(b.calls.load(), 2);
}

// EndIdle sets ending_idle() for the streams still to come, then tells the
// registered ones; tenant changes reach them apart.
TEST(OpenStreamsTest, EndIdleIsSetBeforeTheStreamsHearOfIt) {
  OpenStreams streams;
  CountingStream a(&streams), b(&streams);
  streams.Add(&a);
  streams.Add(&b);
  EXPECT_FALSE(streams.ending_idle());
  streams.Remove(&b);
  streams.EndIdle();
  EXPECT_TRUE(streams.ending_idle());
  EXPECT_EQ(a.end_idle_calls.load(), 1);
  EXPECT_EQ(a.unset.load(), 0);
  EXPECT_EQ(a.calls.load(), 0);
  EXPECT_EQ(b.end_idle_calls.load(), 0);
}

// A stream that blocks in OnTenantsChanged until released.
class BlockingStream : public OpenStreamListener {
 public:
  void OnEndIdle() override {}
  void OnTenantsChanged() override {
    entered.Notify();
    release.WaitForNotification();
    returned.store(true);
  }
  absl::Notification entered, release;
  std::atomic<bool> returned{false};
};

// Remove waits for a call in progress, so a stream that removed itself can
// be destroyed.
TEST(OpenStreamsTest, RemoveWaitsForACallInProgress) {
  OpenStreams streams;
  BlockingStream stream;
  streams.Add(&stream);
  std::thread changer([&] { streams.TenantsChanged(); });
  stream.entered.WaitForNotification();
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    streams.Remove(&stream);
    removed.store(true);
    EXPECT_TRUE(stream.returned.load());
  });
  // However long it is given, Remove cannot return during the call.
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(removed.load());
  stream.release.Notify();
  remover.join();
  changer.join();
  EXPECT_TRUE(removed.load());
}

}  // namespace
}  // namespace attention::server

#include "server/open_streams.h"

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

class CountingStream : public TenantsChangedListener {
 public:
  void OnTenantsChanged() override { calls.fetch_add(1); }
  std::atomic<int> calls{0};
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

// A stream that blocks in OnTenantsChanged until released.
class BlockingStream : public TenantsChangedListener {
 public:
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

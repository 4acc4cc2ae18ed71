// Unit tests of server/attention_server.h's process-wide settings (the
// server itself is exercised by the integration tests).
#include "server/attention_server.h"

#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// Takes two mutexes in one order, then in the other: a lock-order cycle,
// which absl's deadlock detection reports (and, in its default mode when
// absl is built without NDEBUG, as Debian's is, aborts on).
void InvertLockOrder() {
  absl::Mutex a;
  absl::Mutex b;
  {
    absl::MutexLock first(&a);
    absl::MutexLock second(&b);
  }
  {
    absl::MutexLock first(&b);
    absl::MutexLock second(&a);
  }
}

TEST(ConfigureServingProcessTest, ReleaseBuildsSkipDeadlockDetection) {
#ifndef NDEBUG
  GTEST_SKIP() << "builds without NDEBUG keep absl's deadlock detection";
#else
  EXPECT_EXIT(
      {
        ConfigureServingProcess();
        InvertLockOrder();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
#endif
}

}  // namespace
}  // namespace attention::server

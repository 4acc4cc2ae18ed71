#include "server/transport_limits.h"

#include <sys/resource.h>

#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(TransportLimitsTest, TheOpenFilesLimitIsRaisedToTheHardLimit) {
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_max <= 64) GTEST_SKIP() << "hard limit too low to lower";
  // As under systemd's usual soft limit: lower than the hard one.
  rlimit lowered = limit;
  lowered.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  const int64_t raised = RaiseOpenFilesLimit();
  rlimit now{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_EQ(now.rlim_cur, limit.rlim_max);
  if (now.rlim_cur != RLIM_INFINITY) {
    EXPECT_EQ(raised, static_cast<int64_t>(now.rlim_cur));
  }
}

}  // namespace
}  // namespace attention::server

// The logit-overflow rule and the error order of attention_problem.h on the
// CPU backend (the CUDA backend runs the same cases in cuda_backend_test).
#include <cmath>
#include <string>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/core/logit_overflow_cases.h"

namespace attention {
namespace {

TEST(LogitOverflowTest, CpuReportsExactlyTheOverflowingScaledLogits) {
  CpuBackend cpu(1);
  for (const testing::LogitOverflowCase& c : testing::LogitOverflowCases()) {
    SCOPED_TRACE(c.name);
    std::vector<float> output;
    float lse = 0.0f;
    const absl::Status status =
        testing::RunLogitOverflowCase(cpu, c, &output, &lse);
    if (c.overflows) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      continue;
    }
    ASSERT_TRUE(status.ok()) << status;
    // One key: the output is its value row, the lse its logit (exact here:
    // products of powers of two).
    EXPECT_EQ(output, std::vector<float>(16, 1.0f));
    EXPECT_EQ(lse, static_cast<float>(static_cast<double>(c.q_value) *
                                      c.k_value * c.scale));
  }
}

}  // namespace
}  // namespace attention

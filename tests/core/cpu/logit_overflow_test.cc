// The logit-overflow rule and the error order of attention_problem.h on the
// CPU backend (the CUDA backend runs the same cases in cuda_backend_test).
#include <cmath>
#include <string>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/core/logit_overflow_cases.h"
#include "tests/core/reference_attention.h"

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

// The tests' double-precision reference applies the same rule, q.k alone
// past the float32 range included.
TEST(LogitOverflowTest, TheReferenceAgreesOnEveryCase) {
  for (const testing::LogitOverflowCase& c : testing::LogitOverflowCases()) {
    SCOPED_TRACE(c.name);
    testing::ReferenceInputs in;
    in.num_queries = 1;
    in.num_heads = 1;
    in.num_kv_heads = 1;
    in.head_dim = 16;
    in.value_dim = 16;
    in.num_keys = 1;
    in.q.assign(16, 0.0f);
    in.q[3] = c.q_value;
    in.k.assign(16, 0.0f);
    in.k[3] = c.k_value;
    in.v.assign(16, 1.0f);
    in.scale = c.scale;
    const absl::Status status = testing::ReferenceAttention(in).status();
    EXPECT_EQ(status.code(), c.overflows ? absl::StatusCode::kInvalidArgument
                                         : absl::StatusCode::kOk)
        << status;
  }
}

}  // namespace
}  // namespace attention
